"""CUDA-only checks (``make gpu-check`` runs them; they skip on a machine without a GPU).

The lean decoder on CUDA against HF, every Triton kernel against its PyTorch reference on CUDA
tensors (compiled, not interpreted), greedy speculative decoding == greedy AR on CUDA with both
kernel backends, and a short bf16-mixed training run on the GPU through ``train.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_llama

from draftsmith.drafters.eagle import EagleConfig, EagleDrafter
from draftsmith.export.format import read_export
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
from draftsmith.kernels.attention import tree_attention
from draftsmith.kernels.kv_compact import compact_kv
from draftsmith.kernels.verify import greedy_verify
from draftsmith.runtime.acceptance.verifiers import GreedyVerifier
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.eagle_adapters import Eagle1DraftModel
from draftsmith.runtime.drafting.eagle_proposer import EagleProposer
from draftsmith.runtime.drafting.medusa import MedusaProposer
from draftsmith.runtime.target.model import LeanDecoder, ModelConfig

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.device("cuda")
PROMPTS = [[5, 9, 13, 40], [7, 60, 61], [30, 31, 32, 33, 34, 35, 100, 101, 8]]
NEW = 40
MEDUSA_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1], [0, 0, 0], [0, 1, 0], [1, 0, 0]]


@pytest.fixture(autouse=True)
def _exact_fp32():
    """fp32 comparisons must not silently run on TF32 tensor cores."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(scope="module")
def hf_model(tiny_tokenizer):
    """A tiny random Llama whose greedy argmax has clear margins (as in the EAGLE runtime tests), on
    CUDA."""
    return build_tiny_llama(len(tiny_tokenizer), initializer_range=0.2).to(CUDA)


def lean_on_cuda(
    hf: torch.nn.Module, kernels: str, dtype: torch.dtype = torch.float32
) -> LeanDecoder:
    """The lean decoder over the HF model's weights, on CUDA."""
    weights = {k: v.detach().to(dtype).clone() for k, v in hf.state_dict().items()}
    return LeanDecoder(
        ModelConfig.from_hf_dict(hf.config.to_dict()), weights, kernel_backend=kernels
    ).eval()


def plain_greedy(model: LeanDecoder, prompt: list[int], n: int) -> list[int]:
    """One token per forward: the reference every speculative run must reproduce."""
    cache = model.allocate_cache(len(prompt) + n)
    with torch.inference_mode():
        logits = model.forward(torch.tensor(prompt, device=CUDA), cache).logits
        cache.commit(len(prompt))
        out = [int(logits[-1].argmax())]
        while len(out) < n:
            logits = model.forward(torch.tensor(out[-1:], device=CUDA), cache).logits
            cache.commit(1)
            out.append(int(logits[-1].argmax()))
    return out


# ---- lean decoder vs HF --------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_lean_decoder_on_cuda_matches_hf_logits_fp32(hf_model, kernels):
    lean = lean_on_cuda(hf_model, kernels)
    assert lean.device.type == "cuda"
    ids = torch.tensor(PROMPTS[2] + PROMPTS[0], device=CUDA)
    with torch.inference_mode():
        want = hf_model(ids[None]).logits[0].float()  # [T, V]
        cache = lean.allocate_cache(ids.numel())
        prefill = lean.forward(
            ids[:6], cache
        ).logits  # prefill, then token-by-token through the static cache
        cache.commit(6)
        steps = []
        for i in range(6, ids.numel()):
            logits = lean.forward(ids[i : i + 1], cache).logits
            cache.commit(1)
            steps.append(logits)
    got = torch.cat([prefill, *steps]).float()
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


# ---- Triton kernels vs their references, on CUDA -------------------------------------------------

ATTN_CASES = [  # (Hq, Hkv, T, S, prefix_len, d, tree)
    (4, 2, 1, 64, 40, 16, False),  # decode step, GQA
    (9, 3, 1, 300, 257, 64, False),  # SmolLM2-135M heads, prefix over several key blocks
    (9, 3, 16, 300, 200, 64, True),  # a 16-node verify tree
    (4, 1, 20, 64, 3, 24, True),  # head dim not a power of two, more queries than one block, MQA
    (2, 2, 6, 6, 0, 8, True),  # no prefix
]


def random_tree_mask(t: int, gen: torch.Generator) -> torch.Tensor:
    """A valid tree mask: random parents, each node sees itself and its ancestors."""
    mask = torch.eye(t, dtype=torch.bool)
    for i in range(1, t):
        mask[i] |= mask[int(torch.randint(0, i, (1,), generator=gen))]
    return mask


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", ATTN_CASES)
def test_tree_attention_triton_matches_torch_on_cuda(case, dtype, atol):
    hq, hkv, t, s, p, d, tree = case
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    q, k, v = (
        torch.randn(h, n, d, generator=gen).to(CUDA, dtype)
        for h, n in ((hq, t), (hkv, s), (hkv, s))
    )
    mask = random_tree_mask(t, gen).to(CUDA) if tree else None
    ref = tree_attention(q, k, v, p, mask, d**-0.5, backend="torch")
    out = tree_attention(q, k, v, p, mask, d**-0.5, backend="triton")
    assert out.is_cuda and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_compaction_triton_matches_torch_on_cuda(dtype):
    gen = torch.Generator().manual_seed(0)
    for src, dst in ([5, 6, 7], 4), ([9, 13, 14, 20], 9), ([10, 15, 21], 3), ([300], 0):
        k = torch.randn(30, 3, 320, 64, generator=gen).to(
            CUDA, dtype
        )  # [L, Hkv, S, d] as SmolLM2's cache
        v = torch.randn(30, 3, 320, 64, generator=gen).to(CUDA, dtype)
        k2, v2 = k.clone(), v.clone()
        compact_kv(k, v, torch.tensor(src, device=CUDA), dst, backend="torch")
        compact_kv(k2, v2, torch.tensor(src, device=CUDA), dst, backend="triton")
        assert torch.equal(k, k2) and torch.equal(v, v2), (src, dst)


@pytest.mark.parametrize("vocab", [49152, 50, 7])
def test_greedy_verify_triton_matches_torch_on_cuda(vocab):
    paths = torch.tensor([[0, 1, 3, 6], [0, 1, 4, -1], [0, 2, 5, -1], [0, 2, -1, -1]], device=CUDA)
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        # Small integer logits make ties: both backends must pick the first maximal index.
        logits = (
            torch.randint(0, 3, (7, vocab), generator=gen).float()
            if vocab < 100
            else torch.randn(7, vocab, generator=gen)
        ).to(CUDA)
        tokens = torch.randint(0, vocab, (7,), generator=gen).to(CUDA)
        amax = logits.argmax(-1)
        tokens[1], tokens[3] = amax[0], amax[1]  # path 0 matches for a while
        ref = greedy_verify(paths, tokens, logits, backend="torch")
        out = greedy_verify(paths, tokens, logits, backend="triton")
        assert (out.best_path, out.accept_len, out.bonus_token) == (
            ref.best_path,
            ref.accept_len,
            ref.bonus_token,
        )
        assert torch.equal(out.accept_lens.long(), ref.accept_lens.long())
        assert torch.equal(out.argmax.long(), ref.argmax.long())


# ---- greedy speculative == greedy AR on CUDA -----------------------------------------------------


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_greedy_speculative_medusa_and_eagle_equal_greedy_ar_on_cuda(hf_model, kernels):
    lean = lean_on_cuda(hf_model, kernels)
    torch.manual_seed(0)
    heads = (
        MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=lean.config.vocab_size, num_heads=3))
        .to(CUDA)
        .eval()
    )
    eagle = EagleDrafter(
        EagleConfig(**EagleConfig.dims_from_hf(hf_model.config)),
        lean.embed_weight,
        lean.lm_head_weight,
    ).to(CUDA)
    proposers = {
        "medusa": MedusaProposer(heads, MEDUSA_TREE, top_k=2),
        "eagle-tree": EagleProposer(
            Eagle1DraftModel(eagle), "tree", total_tokens=10, depth=3, top_k=3
        ),
        "eagle-chain": EagleProposer(Eagle1DraftModel(eagle), "chain", depth=3),
    }
    for name, proposer in proposers.items():
        dec = SpeculativeDecoder(lean, proposer, GreedyVerifier(kernels), kernel_backend=kernels)
        for prompt in PROMPTS:
            assert dec.generate(prompt, NEW).tokens == plain_greedy(lean, prompt, NEW), (
                name,
                kernels,
                prompt,
            )


# ---- training on the GPU -------------------------------------------------------------------------


def test_three_step_bf16_mixed_training_on_gpu(tmp_path, tiny_target_dir, tiny_data_file):
    run_dir = tmp_path / "run"
    overrides = [
        "recipe=medusa",
        f"target={tiny_target_dir}",
        "target.dtype=bf16",
        f"data={tiny_data_file}",
        "data.limit=null",
        "data.max_length=48",
        "data.batch_size=4",
        "data.val_fraction=0.1",
        "trainer=gpu",
        "trainer.max_steps=3",
        "trainer.log_every_n_steps=1",
        "run.checkpoint_every=100",
        "run.final_eval_batches=2",
        "optim.warmup_steps=0",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HYDRA_FULL_ERROR": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.JSONDecoder().raw_decode(proc.stdout[proc.stdout.rindex('{\n  "recipe"') :])[0]
    assert summary["steps"] == 3
    assert all(torch.isfinite(torch.tensor(v)) for v in summary["metrics"].values())
    config, state = read_export(run_dir / "export")
    assert config["method"] == "medusa" and config["training"]["steps"] == 3
    assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())
    composed = (run_dir / ".hydra" / "config.yaml").read_text()  # what Lightning was given
    # bf16-mixed on a GPU with bf16
    assert "accelerator: gpu" in composed and "precision: auto" in composed
