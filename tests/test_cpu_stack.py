"""The fused C++ kernel's ``TargetStack`` (a whole target forward in one call), in each ISA
variant this CPU runs (AVX512-BF16, AVX2), against the per-layer path: bit for bit, rows
independent of how many tokens are verified, greedy decoding, row-wise forwards, bad inputs. The
drafter's calls (``norm_linear_topk``, the norm-less layer): tests/test_cpu_draft_calls.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import runnable_isas
from test_runtime_model import tiny_model

from draftsmith.kernels import cpu_layer
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.target.model import LeanDecoder

RUNNABLE = runnable_isas()  # fixtures `ext` / `use_variant` in conftest.py
pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not RUNNABLE, reason=str(cpu_layer.why_unavailable())),
]


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
        # the per-layer path: Python loop over decoder_layer, then norm and head
        model._stack = None
        want = model(cache=caches[1], **step)
        for name in ("logits", "argmax", "hidden"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
        assert sorted(got.taps) == sorted(want.taps) == sorted(step.get("taps", ()))
        assert all(torch.equal(got.taps[i], want.taps[i]) for i in want.taps)
        assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
        # commit the prefill / a 3-node path
        n = step["input_ids"].numel() if "tree_mask" not in step else 3
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
        # not committed: the next T overwrites
        assert torch.equal(model(new[:t], batch).logits, alone[:t]), f"T={t}"
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
