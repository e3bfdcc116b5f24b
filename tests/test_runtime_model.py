"""Lean decoder, static cache, trees and compaction, greedy AR decoding and bf16 against
transformers on tiny random models, and clear errors (sampling, EOS, the HF fallback and the bench
harness: test_autoregressive_decoding.py)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.target.cache import CacheFullError
from draftsmith.runtime.target.linear_ops import mkldnn_linear_available
from draftsmith.runtime.target.loading import load_decoder
from draftsmith.runtime.target.model import LeanDecoder, ModelConfig, UnsupportedArchitecture
from draftsmith.runtime.target.weights import WeightsError

pytestmark = pytest.mark.unit

VOCAB = 128
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CASES = {
    "llama_tied": ("Llama", {"tie_word_embeddings": True}),
    "llama_bias_llama3rope": (
        "Llama",
        {"attention_bias": True, "mlp_bias": True, "rope_scaling": LLAMA3_ROPE},
    ),
    "mistral": ("Mistral", {}),
    "qwen2_bias": ("Qwen2", {}),
    "qwen3_qknorm": ("Qwen3", {"head_dim": 16}),
}


def tiny_model(kind: str, folder, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A 2-layer random HF model (GQA 4/2 heads) with non-trivial norms/biases, saved to
    ``folder``."""
    torch.manual_seed(seed)
    kw = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
    )
    kw.update(overrides)
    config = getattr(transformers, f"{kind}Config")(**kw)
    model = getattr(transformers, f"{kind}ForCausalLM")(config).eval()
    # default init makes norms 1 and biases 0, which would hide wiring mistakes
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif "bias" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return model


@pytest.fixture(params=sorted(CASES))
def case(request, tmp_path):
    kind, overrides = CASES[request.param]
    hf = tiny_model(kind, tmp_path, **overrides)
    return hf, tmp_path


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, V]


def tree_case() -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """A 7-node tree: parents, ancestor mask [7, 7] and depths."""
    parents = [-1, 0, 0, 1, 1, 2, 5]
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for i, par in enumerate(parents):
        mask[i, i] = True
        if par >= 0:
            mask[i] |= mask[par]
            depth[i] = depth[par] + 1
    return parents, mask, depth


def path_to(parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


# ---- parity with transformers --------------------------------------------------------------------


def test_prefill_and_incremental_logits_match_hf(case):
    hf, folder = case
    lean = LeanDecoder.from_pretrained(folder)
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(hf, ids)
    cache = lean.allocate_cache(16)
    res = lean(torch.tensor(ids[:8]), cache)
    logits, hidden = res.logits, res.hidden
    cache.commit(8)
    steps = [logits]
    for tok in ids[8:]:
        step_logits = lean(torch.tensor([tok]), cache, logits_for="last").logits
        cache.commit(1)
        steps.append(step_logits)
    torch.testing.assert_close(torch.cat(steps), ref, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        ref_hidden = hf.model(torch.tensor([ids[:8]])).last_hidden_state[0]
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-4, rtol=1e-4)  # post-final-norm hidden


def test_config_reads_family_features(tmp_path):
    tiny_model("Qwen2", tmp_path / "q2")
    tiny_model("Llama", tmp_path / "l3", rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True)
    q2 = ModelConfig.from_folder(tmp_path / "q2")
    l3 = ModelConfig.from_folder(tmp_path / "l3")
    assert (q2.qkv_bias, q2.o_bias, q2.sliding_window) == (True, False, None)
    assert (l3.rope_type, l3.tie_word_embeddings, l3.num_kv_heads, l3.head_dim) == (
        "llama3",
        True,
        2,
        16,
    )


def test_sharded_checkpoint_and_taps_match_hf(tmp_path):
    hf = tiny_model("Llama", tmp_path / "m")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    lean = LeanDecoder.from_pretrained(tmp_path / "sharded")
    ids = [3, 14, 15, 92, 65, 35]
    cache = lean.allocate_cache(8)
    res = lean.forward(torch.tensor(ids), cache, taps=(0, 1, 2))
    logits, taps = res.logits, res.taps
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(logits, out.logits[0], atol=1e-4, rtol=1e-4)
    for i in (
        0,
        1,
    ):  # HF's hidden_states[i] is the input of layer i; its last entry is post-norm, our tap is not
        torch.testing.assert_close(taps[i], out.hidden_states[i][0], atol=1e-4, rtol=1e-4)
    assert taps[2].shape == (len(ids), 64)


# ---- trees and compaction (lean and HF fallback share the contract) ------------------------------


@pytest.mark.parametrize("backend", ["lean", "hf"])
@pytest.mark.parametrize("kind", ["Llama", "Qwen3"])
def test_tree_forward_equals_per_path_decoding(tmp_path, backend, kind):
    tiny_model(kind, tmp_path, head_dim=16)
    model = load_decoder(tmp_path, backend=backend)
    prompt = [5, 17, 99, 3, 42, 8]
    parents, mask, depth = tree_case()
    tokens = [11, 23, 7, 64, 2, 90, 31]
    cache = model.allocate_cache(32)
    model(torch.tensor(prompt), cache)
    cache.commit(len(prompt))
    res = model(torch.tensor(tokens), cache, tree_mask=mask, positions=len(prompt) + depth)
    logits, hidden = res.logits, res.hidden
    for node in range(len(tokens)):
        path = [tokens[j] for j in path_to(parents, node)]
        ref_cache = model.allocate_cache(32)
        ref = model(torch.tensor(prompt + path), ref_cache, logits_for="last")
        ref_logits, ref_hidden = ref.logits, ref.hidden
        torch.testing.assert_close(logits[node], ref_logits[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hidden[node], ref_hidden[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_compaction_keeps_exactly_the_accepted_path(tmp_path, backend):
    tiny_model("Llama", tmp_path)
    model = load_decoder(tmp_path, backend=backend)
    prompt = [5, 17, 99, 3]
    parents, mask, depth = tree_case()
    tokens = [11, 23, 7, 64, 2, 90, 31]
    accepted = path_to(parents, 6)  # nodes 0, 2, 5, 6
    p = len(prompt)
    cache = model.allocate_cache(24)
    model(torch.tensor(prompt), cache)
    cache.commit(p)
    model(torch.tensor(tokens), cache, tree_mask=mask, positions=p + depth)
    cache.compact(torch.tensor(accepted) + p, p)
    assert cache.length == p + len(accepted)
    ref_cache = model.allocate_cache(24)
    model(torch.tensor(prompt + [tokens[j] for j in accepted]), ref_cache)
    ref_cache.commit(cache.length)
    for tok in [4, 77, 12]:  # continue decoding on both caches
        got = model(torch.tensor([tok]), cache).logits
        want = model(torch.tensor([tok]), ref_cache).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        cache.commit(1)
        ref_cache.commit(1)


# ---- autoregressive decoding ---------------------------------------------------------------------


def test_generate_ar_greedy_matches_hf_generate(case):
    hf, folder = case
    lean = LeanDecoder.from_pretrained(folder)
    prompt = [7, 1, 33, 90, 4]
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=20, do_sample=False, min_new_tokens=20
        )
    assert generate_ar(lean, prompt, 20) == ref[0, len(prompt) :].tolist()


def test_bf16_runs_close_to_fp32(tmp_path):
    tiny_model("Llama", tmp_path)
    ids = torch.tensor([5, 6, 7, 8])
    f32 = LeanDecoder.from_pretrained(tmp_path)
    ref = f32(ids, f32.allocate_cache(8)).logits
    backends = (
        ["dense", "mkldnn"]
        if mkldnn_linear_available(torch.bfloat16, torch.device("cpu"))
        else ["dense"]
    )
    for backend in backends:  # oneDNN-prepacked and plain bf16 linears
        b16 = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend=backend)
        res = b16(ids, b16.allocate_cache(8))
        got, hidden = res.logits, res.hidden
        assert got.dtype == hidden.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref, atol=0.1, rtol=0.05)
    with pytest.raises(ValueError, match="bf16 weights on CPU"):
        LeanDecoder.from_pretrained(tmp_path, linear_backend="mkldnn")  # fp32


# ---- clear errors --------------------------------------------------------------------------------


def test_missing_folder_weights_and_lm_head(tmp_path):
    with pytest.raises(WeightsError, match="does not exist"):
        LeanDecoder.from_pretrained(tmp_path / "nope")
    hf = tiny_model("Llama", tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no safetensors"):
        LeanDecoder.from_pretrained(tmp_path / "m")
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(WeightsError, match="lm_head.weight is missing"):
        LeanDecoder(config, state)
    with pytest.raises(WeightsError, match="q_proj"):
        LeanDecoder(
            config,
            {k: v for k, v in hf.state_dict().items() if "layers.1.self_attn.q_proj" not in k},
        )


def test_unsupported_rope_type(tmp_path):
    tiny_model("Llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match="rope type 'yarn'"):
        LeanDecoder.from_pretrained(tmp_path)


def test_prompt_longer_than_cache_and_empty_inputs(tmp_path):
    tiny_model("Llama", tmp_path)
    lean = LeanDecoder.from_pretrained(tmp_path)
    cache = lean.allocate_cache(4)
    with pytest.raises(CacheFullError, match="do not fit"):
        lean(torch.arange(6), cache)
    assert cache.length == 0 and not cache.k.any() and not cache.v.any()  # nothing was written
    with pytest.raises(ValueError, match="non-empty"):
        lean(torch.tensor([], dtype=torch.long), cache)
    with pytest.raises(ValueError, match="prompt is empty"):
        generate_ar(lean, [], 5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate_ar(lean, [1, VOCAB + 3], 5)
    with pytest.raises(ValueError, match="logits_for"):
        lean(torch.tensor([1]), cache, logits_for="first")
