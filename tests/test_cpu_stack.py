"""The fused C++ kernel's calls beyond the single layer, in each ISA variant this CPU runs
(AVX512-BF16, AVX2): ``norm_linear_topk`` (a draft head: norm, GEMM, softmax, top-k),
``decoder_layer`` without an input norm (EAGLE-1's layer) and ``TargetStack`` (a whole target
forward in one call), each against its torch / per-layer reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import runnable_isas
from test_runtime_model import tiny_model

from draftsmith.kernels import cpu_layer
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.target.model import LeanDecoder
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


def test_decoder_layer_without_input_norm(ext):
    """ln1=None runs the layer on x itself: it matches the norm-less torch layer (to bf16 rounding),
    and differs clearly from the same layer with a unit-weight input norm (x is large, so the norm
    matters)."""
    torch.manual_seed(3)
    hid, hq, hkv, d, inter, start, t, eps = 64, 4, 2, 16, 96, 5, 3, 1e-5
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
    prefix = torch.randn(2, hkv, 16, d).bfloat16()  # K and V [Hkv, S, d], slots 0..start-1 in use
    p = cpu_layer.pack_weight

    def fused(ln1, *full):
        kc, vc = prefix[0].clone(), prefix[1].clone()
        out = ext.decoder_layer(
            x,
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
            start,
            cos,
            sin,
            None,
            hq,
            hkv,
            eps,
            d**-0.5,
            *full,
        )
        return out, kc, vc

    got, kc, vc = fused(None)
    kr, vr = prefix[0].clone(), prefix[1].clone()
    want = normless_layer_reference(x, w, kr, vr, start, cos, sin, hq, hkv, eps)
    err = (got.float() - want).abs().max().item()
    assert err < 0.05 * want.abs().max().item(), err
    torch.testing.assert_close(kc.float(), kr.float(), atol=0.02, rtol=0.02)
    torch.testing.assert_close(
        vc.float(), vr.float(), atol=0, rtol=0
    )  # V is x @ Wv rounded once, both ways
    normed = fused(torch.ones(hid).bfloat16())[0]
    assert (normed.float() - want).abs().max().item() > 10 * err  # the norm really is skipped
    with pytest.raises(RuntimeError, match="ln1 must be"):
        fused(torch.ones(hid - 1).bfloat16())
    # full_mask [T, start+T] (EAGLE-1's tree step): the causal one is the default bit for bit;
    # hiding slots matters
    causal = torch.ones(t, start + t, dtype=torch.bool).tril(start)
    assert torch.equal(fused(None, causal)[0], got) and torch.equal(fused(None, None)[0], got)
    hidden = causal.clone()
    hidden[1:, 1:start] = False  # rows 1.. see only slot 0 of the prefix
    assert not torch.equal(fused(None, hidden)[0][1:], got[1:]) and torch.equal(
        fused(None, hidden)[0][0], got[0]
    )
    with pytest.raises(RuntimeError, match="full_mask"):
        fused(None, torch.ones(t, t, dtype=torch.bool))  # [T, T]: not over every slot


# ---- TargetStack: a whole target forward in one call ---------------------------------------------
class CountingStack:
    """Wraps a StackRunner's C++ stack to count its forward calls (proof that the one-call path
    ran)."""

    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def bind_cache(self, *args):
        return self.stack.bind_cache(*args)

    def forward(self, *args):
        self.calls += 1
        return self.stack.forward(*args)


TREE = torch.tensor(
    [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
    dtype=torch.bool,
)
# (forward kwargs): prefill with taps, a tree-masked verify at tree positions, one-token steps
STEPS = [
    dict(input_ids=torch.tensor([5, 9, 2, 7, 11, 3, 8]), taps=(0, 1, 2)),
    dict(
        input_ids=torch.tensor([4, 6, 12, 1, 30]),
        tree_mask=TREE,
        positions=torch.tensor([7, 8, 8, 9, 9]),
        logits_for=torch.tensor([0, 2, 4]),
        taps=(1,),
    ),
    dict(
        input_ids=torch.tensor([4, 6, 12, 1, 30]),
        tree_mask=TREE,
        positions=torch.tensor([7, 8, 8, 9, 9]),
        head="argmax",
    ),
    dict(input_ids=torch.tensor([10]), logits_for="last", taps=(2, 0)),
    dict(input_ids=torch.tensor([10]), head="argmax"),
]


@pytest.mark.parametrize(
    "kind", ["Llama", "Qwen2", "Qwen3"]
)  # plain; q/k/v biases; per-head q/k norm
def test_stack_equals_per_layer_path_bit_for_bit(tmp_path, use_variant, kind):
    """Logits, argmax, hidden states, taps and every K/V slot written: identical to the per-layer
    decoder_layer path of the same model (same kernels, same order), for T=7, T=5 with a tree mask
    and positions, T=1.
    """
    extra = {"head_dim": 16} if kind == "Qwen3" else {}
    tiny_model(
        kind, tmp_path, vocab_size=203, **extra
    )  # a vocabulary that ends in a partial block of 16 rows
    model = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend="cpp")
    assert model._ops.layer is use_variant.decoder_layer and model._stack is not None
    stack, model._stack.stack = model._stack, CountingStack(model._stack.stack)
    caches = [model.allocate_cache(32) for _ in range(2)]
    for step in STEPS:
        model._stack = stack
        got = model(cache=caches[0], **step)
        model._stack = (
            None  # the per-layer path: Python loop over decoder_layer, then norm and head
        )
        want = model(cache=caches[1], **step)
        for name in ("logits", "argmax", "hidden"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
        assert sorted(got.taps) == sorted(want.taps) == sorted(step.get("taps", ()))
        assert all(torch.equal(got.taps[i], want.taps[i]) for i in want.taps)
        assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
        n = (
            step["input_ids"].numel() if "tree_mask" not in step else 3
        )  # commit the prefill / a 3-node path
        if step.get("head") != "argmax" or "tree_mask" not in step:
            for cache in caches:
                cache.commit(n)
    assert stack.stack.calls == len(STEPS)
    rows = model(torch.tensor([3]), caches[0], logits_for="last").logits
    assert rows.shape == (1, 203)


def test_stack_rows_do_not_depend_on_how_many_tokens_are_verified(tmp_path, use_variant):
    """verify == autoregressive, bit for bit: the logits, greedy argmax and K/V of T = 5, 9, 16 new
    tokens in one causal forward equal those of the same tokens fed one at a time (T = 1 each),
    through every layer, the final norm and the head. (A tiny model's bf16 outputs rarely show a
    change of fp32 summation order; the GEMM's order is pinned with order-sensitive inputs in
    test_cpu_layer.py.)"""
    tiny_model(
        "Qwen2", tmp_path, vocab_size=203
    )  # biases; a vocabulary ending in a partial block of 16 rows
    model = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend="cpp")
    assert model._ops.layer is use_variant.decoder_layer and model._stack is not None
    prompt, new = (
        torch.tensor([5, 9, 2]),
        torch.randint(0, 203, (16,), generator=torch.Generator().manual_seed(4)),
    )
    one, batch = model.allocate_cache(32), model.allocate_cache(32)
    for cache in (one, batch):
        model(prompt, cache)
        cache.commit(3)
    rows = []
    for token in new:  # autoregressive: one token per forward
        rows.append(model(token[None], one).logits)  # [1, V]
        one.commit(1)
    alone = torch.cat(rows)  # [16, V]
    for t in (5, 9, 16):
        assert torch.equal(model(new[:t], batch).logits, alone[:t]), (
            f"T={t}"
        )  # not committed: the next T overwrites
        assert torch.equal(
            model(new[:t], batch, head="argmax").argmax, alone[:t].float().argmax(-1)
        ), f"T={t}"
        assert torch.equal(batch.k[:, :, : 3 + t], one.k[:, :, : 3 + t]), f"T={t}"
        assert torch.equal(batch.v[:, :, : 3 + t], one.v[:, :, : 3 + t]), f"T={t}"


def test_stack_greedy_decoding_matches_reference_tokens(tmp_path, use_variant):
    """generate_ar through the one-call forward (a new cache each generation, so the stack rebinds)
    gives the tokens of the per-layer path and of the torch bf16 reference."""
    tiny_model("Llama", tmp_path)
    fused = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend="cpp")
    ref = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend="dense")
    fused._stack.stack = counting = CountingStack(fused._stack.stack)
    got = generate_ar(fused, [1, 2, 3], 16)
    assert counting.calls >= 16
    again = generate_ar(fused, [4, 5], 8)  # another cache: rebound
    stack, fused._stack = fused._stack, None
    assert got == generate_ar(fused, [1, 2, 3], 16) == generate_ar(ref, [1, 2, 3], 16)
    assert again == generate_ar(fused, [4, 5], 8)
    fused._stack = stack


def test_stack_bad_inputs(tmp_path, ext):
    tiny_model("Llama", tmp_path)
    model = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend="dense")
    layer = [w for w in (model.layers[0].ln1, model.layers[0].wqkv)]  # 2 of the 12
    head = cpu_layer.pack_weight(model.lm_head)
    with pytest.raises(RuntimeError, match="12 weights"):
        ext.TargetStack([layer], model.norm_w, head, 128, 4, 2, 1e-5, 0.25)
    with pytest.raises(RuntimeError, match="do not match the vocabulary"):
        ext.TargetStack([], model.norm_w, head, 300, 4, 2, 1e-5, 0.25)
    stack = ext.TargetStack(
        [], model.norm_w, head, 128, 4, 2, 1e-5, 0.25
    )  # zero layers: norm + head only
    x = torch.randn(2, 64).bfloat16()
    cos = sin = torch.zeros(2, 1, 16).bfloat16()
    with pytest.raises(RuntimeError, match="bind_cache needs one K and V per layer"):
        stack.bind_cache([torch.zeros(1)], [torch.zeros(1)])
    stack.bind_cache([], [])
    logits, hidden, taps = stack.forward(x, 0, cos, sin, None, [0], False, None, False)
    assert torch.equal(hidden, ext.rms_norm(x, model.norm_w, 1e-5)) and torch.equal(taps[0], x)
    assert torch.equal(logits, ext.linear(hidden, head, None, 128))
    with pytest.raises(RuntimeError, match="embeddings"):
        stack.forward(x.float(), 0, cos, sin, None, [], False, None, False)


def test_stack_forward_rows_equals_batch_one_decoding(tmp_path, use_variant):
    """Batched greedy decoding through ``forward_rows`` (one token per row, each row its own cache
    and position, rows refilled as they finish) gives, in bf16, the tokens of batch-1
    ``generate_ar`` through the same stack, bit for bit: the same kernels, one causal token per
    cache. Row ranges that start past row 0 are exercised by the refills.
    """
    from draftsmith.datagen.batched_generation import generate_greedy_batch

    tiny_model(
        "Qwen2", tmp_path, vocab_size=203
    )  # biases; a vocabulary ending in a partial block of 16 rows
    model = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend="cpp")
    assert model._stack is not None
    model._stack.stack = counting = CountingRowsStack(model._stack.stack)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 203, (2 + 3 * i % 11,), generator=gen).tolist() for i in range(7)]
    budgets = [14, 3, 14, 9, 1, 14, 6]
    want = [generate_ar(model, p, b) for p, b in zip(prompts, budgets)]
    assert len({tuple(w) for w in want}) == len(want)  # distinct replies: a row mix-up shows
    for batch_size in (2, 3, 8):
        counting.rows = 0
        assert generate_greedy_batch(model, prompts, budgets, (), batch_size) == want, (
            f"batch {batch_size}"
        )
        assert counting.rows > 0  # the batched steps ran in C++


class CountingRowsStack:
    """A TargetStack wrapper counting forward_rows calls (everything else passes through)."""

    def __init__(self, inner) -> None:
        self.inner, self.rows = inner, 0

    def forward_rows(self, *args):
        self.rows += 1
        return self.inner.forward_rows(*args)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_stack_forward_rows_bad_inputs(tmp_path, ext):
    tiny_model("Llama", tmp_path)
    model = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend="dense")
    w = model.layers[0]
    layer = [
        w.ln1,
        cpu_layer.pack_weight(w.wqkv),
        None,
        None,
        None,
        cpu_layer.pack_weight(w.wo),
        None,
        w.ln2,
        cpu_layer.pack_weight(w.wgu),
        None,
        cpu_layer.pack_weight(w.wdown),
        None,
    ]
    stack = ext.TargetStack(
        [layer], model.norm_w, cpu_layer.pack_weight(model.lm_head), 128, 4, 2, 1e-5, 0.25
    )
    x, pos = torch.randn(2, 64).bfloat16(), torch.tensor([0, 3])
    k = torch.zeros(1, 2, 2, 8, 16).bfloat16()
    cos = sin = torch.zeros(2, 16).bfloat16()
    assert stack.forward_rows(x, k, k.clone(), 0, pos, cos, sin).shape == (2,)
    with pytest.raises(RuntimeError, match="outside its cache"):
        stack.forward_rows(x, k, k.clone(), 0, torch.tensor([0, 8]), cos, sin)
    with pytest.raises(RuntimeError, match="holding rows"):
        stack.forward_rows(x, k, k.clone(), 1, pos, cos, sin)  # rows 1..2 of a 2-row cache
    with pytest.raises(RuntimeError, match="pos \\[b\\] int64"):
        stack.forward_rows(x, k, k.clone(), 0, pos.int(), cos, sin)
    with pytest.raises(RuntimeError, match="embeddings"):
        stack.forward_rows(x.float(), k, k.clone(), 0, pos, cos, sin)
