"""The fused bf16 CPU layer (C++; each ISA variant this CPU runs: AVX512-BF16, AVX2) against the
lean decoder's torch path, its reference, and the variants against each other. The kernel's
linear alone: tests/test_cpu_linear.py."""

from __future__ import annotations

import pytest
import torch
from conftest import runnable_isas
from test_cpu_linear import order_sensitive
from test_runtime_model import tiny_model

from draftsmith.kernels import cpu_layer
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.target.model import LeanDecoder

# the variants this CPU can run; fixtures `ext` / `use_variant` in conftest.py
RUNNABLE = runnable_isas()
pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not RUNNABLE, reason=str(cpu_layer.why_unavailable())),
]


def close_as_bf16_reference(
    got: torch.Tensor, ref_bf16: torch.Tensor, ref_f32: torch.Tensor, what: str
) -> None:
    """``got`` is at most three times as far from the fp32 result as the torch path's bf16 result is
    (plus 1e-3)."""
    budget = 3 * (ref_bf16.float() - ref_f32).abs().max().item() + 1e-3
    err = (got.float() - ref_f32).abs().max().item()
    assert err <= budget, f"{what}: fused error {err:.4g} exceeds {budget:.4g} (torch bf16 path x3)"


@pytest.mark.parametrize(
    "kind", ["Llama", "Qwen2", "Qwen3"]
)  # plain; q/k/v biases; per-head q/k norm
def test_fused_layer_matches_torch_path(tmp_path, use_variant, kind):
    """Prefill, a tree-masked forward at tree positions and a one-token step: logits, hidden states
    and the K/V written to the cache are as close to fp32 as the torch path's bf16 results are
    (errors here are ~4e-3 on logits of ~0.5, so a 10% slip in RoPE or a dropped bias fails)."""
    extra = {"head_dim": 16} if kind == "Qwen3" else {}
    tiny_model(kind, tmp_path, **extra)
    models = [
        LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend=b)
        for b in ("dense", "cpp")
    ]
    models.append(LeanDecoder.from_pretrained(tmp_path, dtype=torch.float32))
    assert models[1]._ops.layer is use_variant.decoder_layer
    caches = [m.allocate_cache(32) for m in models]
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    steps = [
        dict(input_ids=torch.tensor([5, 9, 2, 7, 11, 3, 8])),  # causal prefill
        dict(
            input_ids=torch.tensor([4, 6, 12, 1]),
            tree_mask=tree,
            positions=torch.tensor([7, 8, 8, 9]),
        ),
        dict(input_ids=torch.tensor([10])),
    ]
    for step in steps:
        (ref, ref_h), (got, got_h), (f32, f32_h) = (
            (o.logits, o.hidden) for o in (m(cache=c, **step) for m, c in zip(models, caches))
        )
        close_as_bf16_reference(got, ref, f32, "logits")
        close_as_bf16_reference(got_h, ref_h, f32_h, "hidden")
        start, end = caches[0].length, caches[0].length + step["input_ids"].numel()
        for name in ("k", "v"):
            ref_kv, got_kv, f32_kv = (getattr(c, name)[:, :, start:end] for c in caches)
            close_as_bf16_reference(got_kv, ref_kv, f32_kv, name)
        for cache in caches:
            cache.commit(end - start)


def test_fused_attention_over_a_long_context_matches_torch_path(tmp_path, use_variant):
    """Past 16 cached slots the attention scores whole blocks of 16 K rows per query row at once
    (one reduction for all 16 sums): a 40-token prefill, a 5-token causal step and a 4-token tree
    step at 45-53 slots (rows with whole visible blocks, rows with partly masked ones, a tail) stay
    as close to fp32 as the torch path's bf16 results.
    """
    tiny_model("Llama", tmp_path)
    models = [
        LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend=b)
        for b in ("dense", "cpp")
    ]
    models.append(LeanDecoder.from_pretrained(tmp_path, dtype=torch.float32))
    assert models[1]._ops.layer is use_variant.decoder_layer
    caches = [m.allocate_cache(64) for m in models]
    ids = torch.randint(0, 100, (49,), generator=torch.Generator().manual_seed(1))
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    steps = [
        dict(input_ids=ids[:40]),
        dict(input_ids=ids[40:45]),
        dict(input_ids=ids[45:49], tree_mask=tree, positions=torch.tensor([45, 46, 46, 47])),
    ]
    for step in steps:
        (ref, ref_h), (got, got_h), (f32, f32_h) = (
            (o.logits, o.hidden) for o in (m(cache=c, **step) for m, c in zip(models, caches))
        )
        close_as_bf16_reference(got, ref, f32, "logits")
        close_as_bf16_reference(got_h, ref_h, f32_h, "hidden")
        for cache in caches:
            cache.commit(step["input_ids"].numel())


def test_fused_layer_greedy_decoding_and_taps(tmp_path, use_variant):
    """Greedy decoding through the fused layer follows the torch path's tokens; layer taps are the
    layer inputs."""
    tiny_model("Llama", tmp_path)
    ref = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend="dense")
    fused = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend="cpp")
    assert fused._ops.layer is use_variant.decoder_layer
    assert generate_ar(fused, [1, 2, 3], 16) == generate_ar(ref, [1, 2, 3], 16)
    ids = torch.tensor([3, 4, 5])
    taps_ref = ref.forward(ids, ref.allocate_cache(8), taps=(0, 1, 2)).taps
    taps_got = fused.forward(ids, fused.allocate_cache(8), taps=(0, 1, 2)).taps
    assert sorted(taps_got) == [0, 1, 2]
    assert torch.equal(taps_got[0], taps_ref[0])  # the embeddings themselves
    for i in (1, 2):
        torch.testing.assert_close(taps_got[i].float(), taps_ref[i].float(), atol=0.05, rtol=0.05)


def test_cpp_backend_errors_name_the_reason(tmp_path):
    tiny_model("Llama", tmp_path)
    with pytest.raises(ValueError, match="needs bf16 weights on CPU"):
        LeanDecoder.from_pretrained(tmp_path, linear_backend="cpp")  # fp32
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        LeanDecoder.from_pretrained(tmp_path, linear_backend="fast")
    assert "head_dim 24" in cpu_layer.shapes_supported(24, 64, 96)


def test_variants_report_their_isa(ext):
    assert ext.isa in RUNNABLE and hasattr(ext, "decoder_layer")


@pytest.mark.skipif(len(RUNNABLE) < 2, reason=f"this CPU runs only {RUNNABLE} of {cpu_layer.ISAS}")
def test_variants_agree(tmp_path):
    """The AVX-512 and AVX2 builds run the same math (only the q.k dot product may differ in
    summation order): on the same layer their outputs and cache writes agree to a bf16 rounding step
    or two, and their linears exactly.
    """
    tiny_model(
        "Qwen2", tmp_path, intermediate_size=100
    )  # biases; a partial 16-row block and a SiLU tail
    model = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend="cpp")
    c, weights = model.config, model._exec[0]
    mods = [cpu_layer.load_cpu_layer(isa) for isa in RUNNABLE]
    torch.manual_seed(1)
    x = torch.randn(7, c.hidden_size).bfloat16()  # [T, H]
    prefix = torch.randn(
        2, c.num_kv_heads, 16, c.head_dim
    ).bfloat16()  # K and V [Hkv, S, d]; slots 0-2 used
    cos, sin = model._cos[3:10].contiguous(), model._sin[3:10].contiguous()  # [T, 1, d]
    tree = torch.tril(torch.ones(7, 7, dtype=torch.bool))
    tree[4, 1:4] = False  # a branch: token 4 sees 0 but not 1-3
    outs, caches = [], []
    for mod in mods:
        kc, vc = prefix[0].clone(), prefix[1].clone()
        outs.append(
            mod.decoder_layer(
                x,
                *weights,
                kc,
                vc,
                3,
                cos,
                sin,
                tree,
                c.num_heads,
                c.num_kv_heads,
                c.rms_norm_eps,
                c.head_dim**-0.5,
            )
        )
        caches.append((kc, vc))
    for out in outs[1:]:
        torch.testing.assert_close(out.float(), outs[0].float(), atol=0.02, rtol=0.02)
    for kc, vc in caches[1:]:
        assert torch.equal(kc, caches[0][0]) and torch.equal(
            vc, caches[0][1]
        )  # K/V precede attention: bit-identical
    for x, w in (
        order_sensitive(37, 64, 5, seed=2),
        (torch.randn(5, 64).bfloat16(), torch.randn(37, 64).bfloat16()),
    ):
        ys = [mod.linear(x, cpu_layer.pack_weight(w), None, 37) for mod in mods]
        for y in ys[1:]:
            assert torch.equal(
                y, ys[0]
            )  # vdpbf16ps's order (odd, then even) in both, the same rounding


def test_accelerate_linears_swaps_bf16_cpu_linears_only():
    """Through the default variant (the best this CPU runs)."""
    from draftsmith.runtime.target.fast_linear import PackedLinear, accelerate_linears

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(32, 40), torch.nn.SiLU(), torch.nn.Linear(40, 7, bias=False)
    )
    x = torch.randn(3, 5, 32)
    want = net.bfloat16()(x.bfloat16())
    assert accelerate_linears(net) == 2 and all(isinstance(net[i], PackedLinear) for i in (0, 2))
    assert net[0]._kernel.isa == cpu_layer.pick_isa()[0]
    got = net(x.bfloat16())
    # .weight stays readable
    assert got.shape == (3, 5, 7) and net[0].weight.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=0.03, rtol=0.02)
    # fp32 stays as it is
    assert accelerate_linears(torch.nn.Sequential(torch.nn.Linear(8, 8))) == 0
