"""The fused bf16 CPU layer (C++; each ISA variant this CPU runs: AVX512-BF16, AVX2) against the
lean decoder's torch path, its reference, and the variants against each other."""

from __future__ import annotations

import pytest
import torch
from conftest import runnable_isas
from test_runtime_model import tiny_model

from draftsmith.kernels import cpu_layer
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.target.model import LeanDecoder

RUNNABLE = (
    runnable_isas()
)  # the variants this CPU can run; fixtures `ext` / `use_variant` in conftest.py
pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not RUNNABLE, reason=str(cpu_layer.why_unavailable())),
]


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack_weight, written independently: element (r, k) sits at [r // 16, k // 2, (r %
    16) * 2 + k % 2]."""
    blocks, pairs, _ = packed.shape
    rows = torch.arange(n)[:, None]
    cols = torch.arange(2 * pairs)[None, :]
    return packed[rows // 16, cols // 2, (rows % 16) * 2 + cols % 2]


@pytest.mark.parametrize(
    "n", [37, 16 * 9 + 5]
)  # a lone partial block; four-block groups plus leftover blocks
def test_packed_linear_matches_matmul(ext, n):
    torch.manual_seed(0)
    w = torch.randn(n, 48).bfloat16()
    packed = cpu_layer.pack_weight(w)
    assert packed.shape == (-(-n // 16), 24, 32) and torch.equal(unpack(packed, n), w)
    bias = torch.randn(n).bfloat16()
    for t in (1, 2, 3, 4, 5, 9):  # every token-tile remainder
        x = torch.randn(t, 48).bfloat16()
        ref = (x.float() @ w.float().t() + bias.float()).bfloat16()
        got = ext.linear(x, packed, bias, n)
        assert got.shape == (t, n)
        torch.testing.assert_close(got.float(), ref.float(), atol=0.05, rtol=0.02)
        torch.testing.assert_close(
            ext.linear(x, packed, None, n).float(),
            (x.float() @ w.float().t()),
            atol=0.05,
            rtol=0.02,
        )
    with pytest.raises(ValueError, match="even number"):
        cpu_layer.pack_weight(torch.zeros(4, 3).bfloat16())
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        ext.linear(torch.randn(2, 48), packed, None, n)  # fp32 input
    with pytest.raises(RuntimeError, match="do not match"):
        ext.linear(torch.randn(2, 46).bfloat16(), packed, None, n)


def test_linear_rounds_to_nearest_even_like_torch(ext):
    """y = a + b through the GEMM (fp32 sum, then one rounding): ties, overflow to inf, inf and NaN
    round as torch's fp32 -> bf16 cast does (the AVX2 build rounds with integer arithmetic, AVX-512
    with vcvtneps2bf16).
    """
    torch.manual_seed(0)
    big = torch.finfo(torch.bfloat16).max
    a = torch.cat(
        [
            torch.randn(200),
            torch.tensor([1.0, 1.0, 3.0, big, float("inf"), float("inf"), -big, 0.0]),
        ]
    )
    b = torch.cat(
        [
            torch.randn(200) * 2**-9,
            torch.tensor([2**-8, 3 * 2**-8, 2**-7, big, 1.0, -float("inf"), -big, -0.0]),
        ]
    )
    x = torch.stack([a, b], 1).bfloat16()  # [208, 2]: bf16 a and b whose fp32 sum needs rounding
    w = torch.ones(1, 2).bfloat16()  # y = a + b
    want = (
        x.float() @ w.float().t()
    ).bfloat16()  # [208, 1]; 1 + 2^-8, 1 + 3 * 2^-8 and 3 + 2^-7 are ties
    got = ext.linear(x, cpu_layer.pack_weight(w), None, 1)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])


def pairwise_reference(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, odd_first: bool = True
) -> torch.Tensor:
    """bf16(acc + bias) with acc the fp32 chain, over the column pairs in order, of acc += w[:,
    2p+1] x[2p+1] then acc += w[:, 2p] x[2p] (vdpbf16ps's order; ``odd_first=False`` swaps it): each
    product of two bf16 is exact in fp32, so each step is one fp32 rounding, as an FMA's."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])  # [T, N] fp32
    for p in range(x.shape[1] // 2):
        for c in (2 * p + 1, 2 * p) if odd_first else (2 * p, 2 * p + 1):
            acc = acc + xf[:, c : c + 1] * wf[:, c][None, :]  # exact product, one rounding per add
    return (acc + bias.float()).bfloat16()


def order_sensitive(n: int, k: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [t, k], w [n, k]) bf16 whose products in odd columns are +-2^24, alternating pair by pair
    so that they
    cancel: whether an even product (~16) is added while the sum is near 2^24 (fp32 steps of 2) or
    near 0 shows in the result (~100, bf16 steps of 0.5), so any change in the accumulation order
    changes the bf16 output.
    """
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 4
    w[:, 1::2] = 2.0**12 * (-1.0) ** torch.arange(k // 2) * torch.randn(n, 1, generator=g).sign()
    x = torch.randn(t, k, generator=g) * 4
    x[:, 1::2] = 2.0**12 * torch.randn(t, 1, generator=g).sign()
    return x.bfloat16(), w.bfloat16()


def test_linear_accumulates_pairs_odd_then_even(ext):
    """The GEMM's accumulation order is pinned: bit-equal to the odd-then-even fp32 chain, which the
    other order and a float64 sum both miss."""
    n = 16 * 5 + 3  # a whole group of 4 blocks, one more, and a partial block
    x, w = order_sensitive(n, 64, 9, seed=5)
    bias = torch.randn(n).bfloat16()
    got = ext.linear(x, cpu_layer.pack_weight(w), bias, n)  # [9, n]
    assert torch.equal(got, pairwise_reference(x, w, bias))
    assert not torch.equal(got, pairwise_reference(x, w, bias, odd_first=False))
    assert not torch.equal(got, (x.double() @ w.double().t() + bias.double()).float().bfloat16())


def test_linear_flushes_subnormals_like_vdpbf16ps(ext):
    """Subnormal inputs read as zero and subnormal partial sums flush to zero, in both builds
    (vdpbf16ps does so by itself, the AVX2 build under MXCSR DAZ/FTZ), where torch keeps them;
    normal values are untouched.
    """
    w = torch.tensor([[2.0**10, 2.0**-70]] * 16).bfloat16()  # [16, 2]: columns (even, odd)
    x = torch.tensor([[2.0**-130, 0.0], [0.0, 2.0**-58], [1.0, 2.0**-40]]).bfloat16()  # [3, 2]
    want = (
        x.float() @ w.float().t()
    ).bfloat16()  # torch: 2^-120 (from a subnormal x), 2^-128 (a subnormal sum)
    assert want[:2].ne(0).all()
    got = ext.linear(x, cpu_layer.pack_weight(w), None, 16)  # [3, 16]
    assert got[:2].eq(0).all()
    assert (
        torch.equal(got[2], want[2]) and got[2].eq(2.0**10).all()
    )  # 2^10 + 2^-110: normal, rounded as torch does


@pytest.mark.parametrize(
    "n", [16 * 9 + 5, 1536]
)  # groups plus leftover blocks; an MLP-sized output
def test_a_rows_output_does_not_depend_on_how_many_tokens_share_the_call(ext, n):
    """Lossless verification needs verify == autoregressive: each row of linear / linear_argmax over
    T = 5, 9, 16 tokens (every token-tile remainder) is bit-identical to that row computed alone (T
    = 1), on inputs where any other accumulation order would show (order_sensitive)."""
    x, w = order_sensitive(n, 96, 16, seed=n)
    bias = torch.randn(n).bfloat16()
    packed = cpu_layer.pack_weight(w)
    alone = torch.cat(
        [ext.linear(x[i : i + 1], packed, bias, n) for i in range(16)]
    )  # [16, n], one call per row
    assert torch.equal(alone, pairwise_reference(x, w, bias))
    for t in (5, 9, 16):
        assert torch.equal(ext.linear(x[:t], packed, bias, n), alone[:t]), f"T={t}"
        assert torch.equal(
            ext.linear_argmax(x[:t], packed, bias, n), alone[:t].float().argmax(-1)
        ), f"T={t}"


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
    assert (
        got.shape == (3, 5, 7) and net[0].weight.dtype == torch.bfloat16
    )  # .weight stays readable
    torch.testing.assert_close(got.float(), want.float(), atol=0.03, rtol=0.02)
    assert (
        accelerate_linears(torch.nn.Sequential(torch.nn.Linear(8, 8))) == 0
    )  # fp32 stays as it is
