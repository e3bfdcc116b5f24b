"""Autoregressive decoding (``generate_ar``) on tiny random models: it stops at EOS and streams,
samples reproducibly from a seed (a tiny top-p is greedy), runs the same on the transformers
fallback (which a GPT-2 falls back to), and the bench harness's outputs are lossless against HF
``generate`` (greedy parity with HF per model family: test_runtime_model.py)."""

from __future__ import annotations

import pytest
import torch
import transformers
from test_runtime_model import VOCAB, tiny_model

from draftsmith.bench.timing import compare_outputs, time_hf_generate, time_runtime_ar
from draftsmith.runtime.decoding.autoregressive import generate_ar, sample_token
from draftsmith.runtime.target.hf import HFModelAdapter
from draftsmith.runtime.target.loading import load_decoder
from draftsmith.runtime.target.model import LeanDecoder, UnsupportedArchitecture

pytestmark = pytest.mark.unit


def test_generate_ar_stops_at_eos_and_streams(tmp_path):
    tiny_model("Llama", tmp_path)
    lean = LeanDecoder.from_pretrained(tmp_path)
    free = generate_ar(lean, [7, 1, 33], 12)
    eos = free[5]
    streamed: list[int] = []
    out = generate_ar(lean, [7, 1, 33], 12, eos_ids=(eos,), stream=streamed.append)
    assert out == free[: free.index(eos) + 1] == streamed
    assert generate_ar(lean, [7, 1, 33], 0) == []


def test_hf_adapter_matches_lean_greedy_and_gpt2_falls_back(tmp_path):
    hf = tiny_model("Qwen2", tmp_path / "q")
    lean = load_decoder(tmp_path / "q")
    assert isinstance(lean, LeanDecoder)
    adapter = load_decoder(tmp_path / "q", backend="hf")
    assert isinstance(adapter, HFModelAdapter)
    assert generate_ar(adapter, [3, 9, 27], 16) == generate_ar(lean, [3, 9, 27], 16)
    torch.testing.assert_close(adapter.lm_head_weight, hf.lm_head.weight)

    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=64)
    ).eval()
    gpt2.save_pretrained(tmp_path / "g")
    with pytest.raises(UnsupportedArchitecture, match="gpt2.*backend='hf'"):
        LeanDecoder.from_pretrained(tmp_path / "g")
    with pytest.raises(UnsupportedArchitecture):
        load_decoder(tmp_path / "g", backend="lean")
    fallback = load_decoder(tmp_path / "g")
    assert isinstance(fallback, HFModelAdapter)
    with torch.no_grad():
        ref = gpt2.generate(
            torch.tensor([[3, 9, 27]]), max_new_tokens=10, do_sample=False, min_new_tokens=10
        )
    assert generate_ar(fallback, [3, 9, 27], 10) == ref[0, 3:].tolist()


def test_sampling_is_seeded_and_top_p_tiny_is_greedy(tmp_path):
    tiny_model("Llama", tmp_path)
    lean = LeanDecoder.from_pretrained(tmp_path)

    def sampled(seed: int, **kw) -> list[int]:
        return generate_ar(
            lean,
            [1, 2, 3],
            12,
            temperature=1.0,
            generator=torch.Generator().manual_seed(seed),
            **kw,
        )

    assert sampled(0) == sampled(0)
    assert sampled(0, top_p=1e-6) == generate_ar(lean, [1, 2, 3], 12)
    logits = torch.tensor([0.0, 3.0, 1.0])
    assert sample_token(logits) == 1


def test_bench_outputs_are_lossless_against_hf_generate(tmp_path):
    tiny_model("Llama", tmp_path)
    prompts = [[1, 2, 3], [9, 8, 7, 6]]
    hf_res = time_hf_generate(tmp_path, prompts, max_new_tokens=8)
    ar_res = time_runtime_ar(LeanDecoder.from_pretrained(tmp_path), prompts, max_new_tokens=8)
    for res in (hf_res, ar_res):
        assert res["tokens"] == sum(len(o) for o in res["outputs"]) == 16
        assert res["tokens_per_s"] > 0 and len(res["per_prompt"]) == 2
    assert compare_outputs(hf_res["outputs"], ar_res["outputs"])["all_identical"]
    report = compare_outputs([[1, 2, 3]], [[1, 5, 3]])
    assert report["identical"] == 0 and report["first_mismatch"] == {"prompt": 0, "position": 1}
