"""The fused C++ kernel's calls a drafter makes, in each ISA variant this CPU runs (AVX512-BF16,
AVX2): ``norm_linear_topk`` (a draft head: norm, GEMM, softmax, top-k) and ``decoder_layer``
without an input norm (EAGLE-1's layer, with its tree step's full mask), each against its torch
reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import runnable_isas

from draftsmith.kernels import cpu_layer
from draftsmith.runtime.target.model_config import rope_tables

RUNNABLE = runnable_isas()  # fixtures `ext` / `use_variant` in conftest.py
pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not RUNNABLE, reason=str(cpu_layer.why_unavailable())),
]


# ---- norm_linear_topk ----------------------------------------------------------------------------
def topk_reference(ext, x, norm_w, eps, w, k):
    """softmax over every column of what ``linear`` returns on the torch-normed x, ranked by (prob
    desc, id asc)."""
    if norm_w is not None:
        x = (
            norm_w.float() * F.rms_norm(x.float(), (x.shape[-1],), None, eps).bfloat16().float()
        ).bfloat16()
    probs = torch.softmax(
        ext.linear(x, cpu_layer.pack_weight(w), None, w.shape[0]).float(), -1
    )  # [T, n]
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[
        :, :k
    ]  # ties: the lower id first
    return probs.gather(1, order), order


@pytest.mark.parametrize(
    "n", [77, 16 * 13 + 3]
)  # a partial 16-row block: after one block, after whole groups
@pytest.mark.parametrize("with_norm", [True, False])
def test_norm_linear_topk_matches_torch(ext, n, with_norm):
    torch.manual_seed(n)
    t, kin, eps = 5, 48, 1e-6
    x = (torch.randn(t, kin) * 3).bfloat16()
    x[3] = x[2]  # two equal rows give equal answers
    w = torch.randn(n, kin).bfloat16()
    w[10] = w[40]  # equal columns: a tie the kernel must break towards the lower id
    norm_w = torch.rand(kin).add(0.5).bfloat16() if with_norm else None
    packed = cpu_layer.pack_weight(w)
    for k in range(1, 11):
        probs, ids = ext.norm_linear_topk(x, norm_w, eps, packed, n, k)
        want_p, want_ids = topk_reference(ext, x, norm_w, eps, w, k)
        assert (
            probs.dtype == torch.float32
            and ids.dtype == torch.long
            and probs.shape == ids.shape == (t, k)
        )
        assert torch.equal(ids, want_ids), f"k={k}"
        torch.testing.assert_close(probs, want_p, rtol=1e-6, atol=1e-9)
    # the forced tie: a row where column 40 is in the top 10 ranks column 10 right before it
    top10 = ext.norm_linear_topk(x, norm_w, eps, packed, n, 10)[1]
    for row in top10.tolist():
        if 40 in row:
            assert row.index(10) == row.index(40) - 1


def test_norm_linear_topk_split_over_threads_keeps_ids_and_ties(ext):
    """Columns split over threads (101 blocks of 16, several tasks): every thread count gives the
    reference ids, and a tie between columns that different threads rank (5 and 1600) still puts the
    lower id first."""
    torch.manual_seed(7)
    n, kin, k = 16 * 100 + 7, 48, 10
    x = torch.randn(3, kin).bfloat16()
    w = torch.randn(n, kin).bfloat16()
    w[5] = w[1600] = x[0]  # row 0's two largest logits, equal, in far-apart blocks
    packed = cpu_layer.pack_weight(w)
    want_p, want_ids = topk_reference(ext, x, None, 1e-6, w, k)
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2, 3):
            torch.set_num_threads(nt)
            probs, ids = ext.norm_linear_topk(x, None, 1e-6, packed, n, k)
            assert torch.equal(ids, want_ids), f"threads={nt}"
            torch.testing.assert_close(probs, want_p, rtol=1e-6, atol=1e-9)
            assert ids[0, :2].tolist() == [5, 1600]
    finally:
        torch.set_num_threads(threads)


def test_norm_linear_topk_bad_inputs(ext):
    w = cpu_layer.pack_weight(torch.randn(20, 8).bfloat16())
    x = torch.randn(2, 8).bfloat16()
    with pytest.raises(RuntimeError, match="1 <= k <= n"):
        ext.norm_linear_topk(x, None, 1e-6, w, 20, 0)
    with pytest.raises(RuntimeError, match="1 <= k <= n"):
        ext.norm_linear_topk(x, None, 1e-6, w, 20, 21)
    with pytest.raises(RuntimeError, match="do not match"):
        ext.norm_linear_topk(torch.randn(2, 6).bfloat16(), None, 1e-6, w, 20, 3)
    with pytest.raises(RuntimeError, match="contiguous bf16 x"):
        ext.norm_linear_topk(torch.randn(2, 8), None, 1e-6, w, 20, 3)  # fp32 x
    with pytest.raises(RuntimeError, match="norm_w must be"):
        ext.norm_linear_topk(x, torch.ones(7).bfloat16(), 1e-6, w, 20, 3)


# ---- decoder_layer without an input norm (EAGLE-1) -----------------------------------------------
def normless_layer_reference(x, w, kc, vc, start, cos, sin, hq, hkv, eps):
    """A Llama layer without its input RMSNorm in fp32 from the bf16 weights ``w`` (dense [out,
    in]); K/V written."""
    t, d = x.shape[0], kc.shape[-1]
    f = {name: v.float() for name, v in w.items()}
    qkv = x.float() @ f["wqkv"].t()  # [T, (Hq+2Hkv)d]
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
    qk = qk * cos.float() + qk.roll(d // 2, -1) * sin.float()  # RoPE, signed-sin table
    kc[:, start : start + t] = qk[:, hq:].transpose(0, 1).bfloat16()  # [Hkv, T, d]
    vc[:, start : start + t] = qkv[:, (hq + hkv) * d :].view(t, hkv, d).transpose(0, 1).bfloat16()
    keys = kc[:, : start + t].float().repeat_interleave(hq // hkv, 0)  # [Hq, S, d]
    vals = vc[:, : start + t].float().repeat_interleave(hq // hkv, 0)
    mask = torch.ones(t, start + t, dtype=torch.bool).tril(
        start
    )  # prefix visible, causal among new tokens
    attn = F.scaled_dot_product_attention(
        qk[:, :hq].transpose(0, 1), keys, vals, attn_mask=mask
    )  # [Hq, T, d]
    h = x.float() + attn.transpose(0, 1).reshape(t, hq * d) @ f["wo"].t()  # [T, H]
    gu = F.rms_norm(h, (h.shape[1],), f["ln2"], eps) @ f["wgu"].t()  # [T, 2I]
    inter = gu.shape[1] // 2
    return h + (F.silu(gu[:, :inter]) * gu[:, inter:]) @ f["wdown"].t()  # [T, H]


@dataclass
class NormlessCase:
    """One EAGLE-1 layer call: bf16 weights (dense [out, in]), a large input ``x`` [T, H] (so an
    input norm would matter), RoPE tables for its positions and a K/V prefix ``[2, Hkv, S, d]``
    whose slots 0..start-1 are in use."""

    w: dict[str, torch.Tensor]
    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    prefix: torch.Tensor
    hid: int = 64
    hq: int = 4
    hkv: int = 2
    d: int = 16
    start: int = 5
    t: int = 3
    eps: float = 1e-5

    @classmethod
    def build(cls) -> NormlessCase:
        torch.manual_seed(3)
        hid, hq, hkv, d, inter, start, t = 64, 4, 2, 16, 96, 5, 3
        w = {
            "wqkv": torch.randn((hq + 2 * hkv) * d, hid) * 0.05,
            "wo": torch.randn(hid, hq * d) * 0.1,
            "ln2": torch.rand(hid) + 0.5,
            "wgu": torch.randn(2 * inter, hid) * 0.1,
            "wdown": torch.randn(hid, inter) * 0.1,
        }
        w = {name: v.bfloat16() for name, v in w.items()}
        x = (torch.randn(t, hid) * 4).bfloat16()
        cos, sin = (
            tab[start : start + t].contiguous()
            for tab in rope_tables(
                1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 64, torch.bfloat16, "cpu"
            )
        )
        prefix = torch.randn(2, hkv, 16, d).bfloat16()  # K and V [Hkv, S, d]
        return cls(w, x, cos, sin, prefix)

    def fused(self, ext, ln1, *full):
        """The C++ layer with input norm ``ln1`` (None: none) and optional full mask; its output
        and the K/V caches it wrote."""
        p, w = cpu_layer.pack_weight, self.w
        kc, vc = self.prefix[0].clone(), self.prefix[1].clone()
        out = ext.decoder_layer(
            self.x,
            ln1,
            p(w["wqkv"]),
            None,
            None,
            None,
            p(w["wo"]),
            None,
            w["ln2"],
            p(w["wgu"]),
            None,
            p(w["wdown"]),
            None,
            kc,
            vc,
            self.start,
            self.cos,
            self.sin,
            None,
            self.hq,
            self.hkv,
            self.eps,
            self.d**-0.5,
            *full,
        )
        return out, kc, vc


def test_decoder_layer_without_input_norm(ext):
    """ln1=None runs the layer on x itself: it matches the norm-less torch layer (to bf16 rounding),
    and differs clearly from the same layer with a unit-weight input norm (x is large, so the norm
    matters)."""
    case = NormlessCase.build()
    got, kc, vc = case.fused(ext, None)
    kr, vr = case.prefix[0].clone(), case.prefix[1].clone()
    want = normless_layer_reference(
        case.x, case.w, kr, vr, case.start, case.cos, case.sin, case.hq, case.hkv, case.eps
    )
    err = (got.float() - want).abs().max().item()
    assert err < 0.05 * want.abs().max().item(), err
    torch.testing.assert_close(kc.float(), kr.float(), atol=0.02, rtol=0.02)
    torch.testing.assert_close(
        vc.float(), vr.float(), atol=0, rtol=0
    )  # V is x @ Wv rounded once, both ways
    normed = case.fused(ext, torch.ones(case.hid).bfloat16())[0]
    assert (normed.float() - want).abs().max().item() > 10 * err  # the norm really is skipped
    with pytest.raises(RuntimeError, match="ln1 must be"):
        case.fused(ext, torch.ones(case.hid - 1).bfloat16())


def test_decoder_layer_full_mask_defaults_to_causal_and_hides_slots(ext):
    """full_mask [T, start+T] (EAGLE-1's tree step): the causal one is the default bit for bit;
    hiding slots matters."""
    case = NormlessCase.build()
    t, start = case.t, case.start
    got = case.fused(ext, None)[0]
    causal = torch.ones(t, start + t, dtype=torch.bool).tril(start)
    assert torch.equal(case.fused(ext, None, causal)[0], got) and torch.equal(
        case.fused(ext, None, None)[0], got
    )
    hidden = causal.clone()
    hidden[1:, 1:start] = False  # rows 1.. see only slot 0 of the prefix
    assert not torch.equal(case.fused(ext, None, hidden)[0][1:], got[1:]) and torch.equal(
        case.fused(ext, None, hidden)[0][0], got[0]
    )
    with pytest.raises(RuntimeError, match="full_mask"):
        case.fused(ext, None, torch.ones(t, t, dtype=torch.bool))  # [T, T]: not over every slot
