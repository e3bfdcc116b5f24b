"""The fused bf16 CPU kernel's linear (C++; each ISA variant this CPU runs: AVX512-BF16, AVX2):
its packed weight layout, round-to-nearest-even like torch, vdpbf16ps's accumulation order and
subnormal flush, and rows that do not depend on how many tokens share the call (lossless
verification)."""

from __future__ import annotations

import pytest
import torch
from conftest import runnable_isas

from draftsmith.kernels import cpu_layer

RUNNABLE = runnable_isas()  # the variants this CPU can run; fixtures `ext` / `use_variant`
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
    # 2^10 + 2^-110: normal, rounded as torch does
    assert torch.equal(got[2], want[2]) and got[2].eq(2.0**10).all()


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
