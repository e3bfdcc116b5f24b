"""The draft head's fused top-k (``norm_linear_topk``): the plain-PyTorch reference is the softmax's
top-k with ties broken toward the lower id, and the fused CPU kernel's entry point matches it (its
use in EAGLE draft steps: test_eagle_native.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftsmith.kernels import cpu_layer
from draftsmith.runtime.drafting.eagle_ops import norm_linear_topk_reference

pytestmark = pytest.mark.unit

WHY = cpu_layer.why_unavailable()
EXT = None if WHY else cpu_layer.load_cpu_layer()
HAS_TOPK = EXT is not None and hasattr(EXT, "norm_linear_topk")


def test_norm_linear_topk_reference_is_the_softmax_top_k_with_ties_lower_first():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 32, generator=g).to(torch.bfloat16)  # n = 37: not a multiple of 16
    w[20], w[30] = w[5], w[5]  # three equal columns: ties must come out 5, 20, 30
    x, norm_w = (
        torch.randn(3, 32, generator=g).to(torch.bfloat16),
        torch.rand(32, generator=g).to(torch.bfloat16),
    )

    def dense(rows, weight, bias, n):  # the packed GEMM's stand-in: a bf16 linear
        return F.linear(rows.float(), weight.float()).to(torch.bfloat16)[:, :n]

    x[0] = w[5]  # row 0's largest logit is the tied one
    for norm in (None, norm_w):
        probs, ids = norm_linear_topk_reference(x, norm, 1e-6, w, 37, 6, linear=dense)
        xn = (
            x
            if norm is None
            else norm * F.rms_norm(x.float(), (32,), None, 1e-6).to(torch.bfloat16)
        )
        full = torch.softmax(dense(xn, w, None, 37).float(), -1)  # [3, 37]
        assert probs.shape == ids.shape == (3, 6) and probs.dtype == torch.float32
        assert torch.equal(probs, full.gather(1, ids)) and bool(
            (probs[:, 1:] <= probs[:, :-1]).all()
        )
        assert torch.equal(probs, full.topk(6).values)
    probs, ids = norm_linear_topk_reference(x, None, 1e-6, w, 37, 3, linear=dense)
    assert ids[0].tolist() == [5, 20, 30]


@pytest.mark.skipif(not HAS_TOPK, reason="this build of the fused kernel has no norm_linear_topk")
@pytest.mark.parametrize("norm", [False, True])
def test_the_kernels_norm_linear_topk_matches_the_reference(norm):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(1003, 64, generator=g).to(torch.bfloat16)
    w[700] = w[3]  # a tie: lower index first
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    x[1] = w[3] * 4
    norm_w = torch.rand(64, generator=g).to(torch.bfloat16) + 0.5 if norm else None
    packed = cpu_layer.pack_weight(w)
    got = EXT.norm_linear_topk(x, norm_w, 1e-6, packed, 1003, 7)
    want = norm_linear_topk_reference(x, norm_w, 1e-6, packed, 1003, 7, linear=EXT.linear)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=1e-5)
