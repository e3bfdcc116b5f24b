"""EAGLE-1 / EAGLE-3 draft calls through the fused CPU kernel (issue 25, item 4): fc as ``linear``,
the layer as one native call (``eagle3_layer``, or ``decoder_layer`` with ``ln1=None`` for EAGLE-1),
the head as ``norm_linear_topk``. Native and torch draft steps pick the same tokens, speculative
greedy stays plain greedy, and every part that cannot run natively says why in ``native_plan`` (no
silent fallback)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from test_eagle3_serving_step import bf16_eagle3, compare_steps
from test_speculative import tiny_llama
from test_verify_floor import bf16_decoder

from draftsmith.drafters.eagle import EagleConfig, EagleDrafter
from draftsmith.kernels import cpu_layer
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting import eagle_native
from draftsmith.runtime.drafting.eagle import EagleProposer
from draftsmith.runtime.drafting.eagle_adapters import Eagle1DraftModel, Eagle3DraftModel
from draftsmith.runtime.drafting.eagle_models import StaticDraftKV
from draftsmith.runtime.drafting.eagle_ops import torch_topk
from draftsmith.runtime.target.fast_linear import accelerate_linears

pytestmark = pytest.mark.unit

WHY = cpu_layer.why_unavailable()
EXT = None if WHY else cpu_layer.load_cpu_layer()
needs_cpp = pytest.mark.skipif(EXT is None, reason=str(WHY))
HAS_TOPK = EXT is not None and hasattr(EXT, "norm_linear_topk")
HAS_LN1 = EXT is not None and eagle_native.optional_ln1(EXT) is None
needs_ln1 = pytest.mark.skipif(
    not HAS_LN1, reason="the fused kernel's decoder_layer does not take ln1=None here"
)
OFF = "no fused kernel (injected by the test)"


@pytest.fixture(scope="module")
def target():
    """A bf16 tiny Llama through the fused layer (head_dim 16), with a peaked head: greedy ties are
    rare."""
    if EXT is None:
        pytest.skip(str(WHY))
    hf, _ = tiny_llama(0, vocab=1003, head_scale=8.0)
    return bf16_decoder(hf, "cpp")


def bf16_eagle1(target, seed: int = 0) -> EagleDrafter:
    """A random EAGLE-1 drafter in bf16 over the target's embedding and LM head (head_dim 16)."""
    torch.manual_seed(seed)
    cfg = EagleConfig(
        hidden_size=64,
        vocab_size=1003,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    drafter = EagleDrafter(cfg, target.embed_weight.float(), target.lm_head_weight.float())
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)  # not all ones: a wiring mistake must show
    return drafter.to(torch.bfloat16).eval()


def models(kind: str, target, monkeypatch) -> tuple:
    """(native adapter, torch adapter) over one drafter whose linears are packed (the same GEMM on
    both paths)."""
    if kind == "eagle1":
        drafter = bf16_eagle1(target)
        accelerate_linears(drafter)
        native = Eagle1DraftModel(drafter, target.lm_head_logits, target._head)
    else:
        drafter = bf16_eagle3()
        with torch.no_grad():
            drafter.lm_head.weight.mul_(8.0)  # peaked: the top-k has clear gaps
        accelerate_linears(drafter)
        native = Eagle3DraftModel(drafter)
    with monkeypatch.context() as m:
        m.setattr(eagle_native, "draft_kernel", lambda d: (None, OFF))
        slow = (
            type(native)(drafter, target.lm_head_logits)
            if kind == "eagle1"
            else type(native)(drafter)
        )
    return native, slow


def assert_same_topk(lp, ids, ref_lp, ref_ids, atol: float) -> int:
    """The top-k agree: values within atol, ids equal wherever the reference has no near-tie (a gap
    within twice the values' observed difference) with a neighbour; the last column only through its
    value (its neighbour outside the k may tie). Returns how many ids were compared."""
    torch.testing.assert_close(lp, ref_lp, atol=atol, rtol=0)
    noise = 2 * float((lp - ref_lp).abs().max()) + 1e-6
    tied = (ref_lp[:, 1:] - ref_lp[:, :-1]).abs() <= noise  # [S, k-1]
    loose = F.pad(tied, (1, 0)) | F.pad(tied, (0, 1))
    loose[:, -1] = True
    assert torch.equal(ids[~loose], ref_ids[~loose])
    return int((~loose).sum())


def draft_calls(model, hidden: int, k: int) -> list:
    """(out, log-probs, ids) of a root step, a chain step, and (after a crop) a 3-node tree step."""
    g = torch.Generator().manual_seed(0)
    width = hidden if isinstance(model, Eagle1DraftModel) else 2 * hidden
    feats = torch.randn(6, width, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 1003, (1, 6), generator=g)
    tree = torch.ones(3, 9, dtype=torch.bool)
    tree[0, 7:] = tree[1, 6] = tree[2, 6:8] = False
    results = []
    with torch.no_grad():
        out, lp, top, cache = model.step_topk(model.features(feats), ids, None, None, None, True, k)
        results.append((out, lp, top))
        out, lp, top, cache = model.step_topk(out[:, -1:], ids[:, :1], cache, None, None, True, k)
        results.append((out, lp, top))
        cache = cache.crop(6)
        nodes = torch.randn(1, 3, hidden, generator=g).to(torch.bfloat16)
        out, lp, top, cache = model.step_topk(
            nodes, ids[:, :3], cache, torch.full((1, 3), 6), tree, False, k
        )
        results.append((out, lp, top))
    assert isinstance(cache, StaticDraftKV) and cache.length == 9
    return results


@needs_cpp
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_native_and_torch_draft_steps_pick_the_same_tokens(kind, target, monkeypatch):
    native, slow = models(kind, target, monkeypatch)
    assert slow.native_plan == {"draft_layer": f"torch: {OFF}", "draft_head": f"torch: {OFF}"}
    assert native.native_plan["draft_head"].startswith("native" if HAS_TOPK else "linear in C++")
    compared = 0
    for (o1, lp1, id1), (o2, lp2, id2) in zip(
        draft_calls(native, 64, 5), draft_calls(slow, 64, 5), strict=True
    ):
        torch.testing.assert_close(o1.float(), o2.float(), atol=0.1, rtol=0.05)
        assert (
            lp1.dtype == torch.float32
            and id1.dtype == torch.long
            and lp1.shape == id1.shape == lp2.shape
        )
        assert bool((lp1[:, 1:] <= lp1[:, :-1]).all())  # descending
        compared += assert_same_topk(lp1, id1, lp2, id2, atol=0.05)
    assert compared >= 10


@needs_cpp
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_the_native_head_is_the_top_k_of_the_native_logits(kind, target, monkeypatch):
    """step_topk against log_softmax + top-k of step's logits through the same packed GEMM: the same
    ids, the same log-probs to fp32 rounding."""
    native, _ = models(kind, target, monkeypatch)
    g = torch.Generator().manual_seed(1)
    width = 64 if kind == "eagle1" else 128
    feats = torch.randn(5, width, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 1003, (1, 5), generator=g)
    with torch.no_grad():
        out, logits, _ = native.step(native.features(feats), ids, None, None, None, False)
        out2, lp, top, _ = native.step_topk(native.features(feats), ids, None, None, None, False, 4)
    assert torch.equal(out, out2) and logits.shape == (1, 5, 1003)
    want_lp, want_ids = torch_topk(logits[0], 5)
    assert assert_same_topk(lp, top, want_lp[:, :4], want_ids[:, :4], atol=1e-5) >= 10


@needs_cpp
@needs_ln1
def test_native_eagle1_layer_matches_the_torch_step(target, monkeypatch):
    """``linear`` (fc) + ``decoder_layer(ln1=None)`` against the torch serving step, to bf16
    rounding."""
    native, slow = models("eagle1", target, monkeypatch)
    assert native.native_plan["draft_layer"].startswith("native") and native._layer_native
    compare_steps(
        lambda h, i, c, p, m: native.step(h, i, c, p, m, last_only=False),
        lambda h, i, c, p, m: slow.step(h, i, c, p, m, last_only=False),
        64,
        torch.bfloat16,
        {"atol": 0.1, "rtol": 0.05},
        lambda f: f[None, :, :64],
    )


class LayerSpy:
    """The kernel with ``decoder_layer`` counted: how many calls passed a full_mask [S, P+S] (a
    native tree step)."""

    def __init__(self, ext) -> None:
        self.ext, self.tree_calls, self.calls = ext, 0, 0

    def __getattr__(self, name: str):
        return getattr(self.ext, name)

    def decoder_layer(self, *args):
        self.calls += 1
        self.tree_calls += len(args) == 24 and args[-1] is not None
        return self.ext.decoder_layer(*args)


@needs_cpp
@needs_ln1
def test_eagle1_tree_steps_run_natively_and_match_torch(target, monkeypatch):
    """A tree step (nodes seeing only their ancestors among the cached slots) goes through
    ``decoder_layer`` with a full_mask, and picks the torch path's tokens (ties aside); speculative
    greedy with such trees is plain greedy.
    """
    native, slow = models("eagle1", target, monkeypatch)
    assert native.native_plan["draft_layer"] == "native (chains, root and tree steps)"
    spy = LayerSpy(EXT)
    monkeypatch.setattr(native, "_kernel", spy)
    calls = list(zip(draft_calls(native, 64, 5), draft_calls(slow, 64, 5), strict=True))
    assert spy.calls == 3 and spy.tree_calls == 1  # root, chain, tree: all three native
    (o1, lp1, id1), (o2, lp2, id2) = calls[-1]  # the tree step
    torch.testing.assert_close(o1.float(), o2.float(), atol=0.1, rtol=0.05)
    assert assert_same_topk(lp1, id1, lp2, id2, atol=0.05) >= 6
    prompt, new = [1, 5, 9, 300, 7], 24
    proposer = EagleProposer(native, policy="tree", total_tokens=8, depth=3, top_k=3)
    res = SpeculativeDecoder(target, proposer).generate(prompt, new)
    assert res.tokens == generate_ar(target, prompt, new) and spy.tree_calls > 1


@needs_cpp
@needs_ln1
def test_a_kernel_without_full_mask_runs_eagle1_tree_steps_in_torch(target, monkeypatch):
    """A build whose decoder_layer takes ln1=None but no full_mask: chains native, tree steps in
    torch, same tokens."""
    native, _ = models("eagle1", target, monkeypatch)
    spy = LayerSpy(EXT)
    older = types.SimpleNamespace(
        linear=EXT.linear,
        norm_linear_topk=getattr(EXT, "norm_linear_topk", None),
        decoder_layer=lambda *a: spy.decoder_layer(*a),
    )
    older.decoder_layer.__doc__ = (
        "decoder_layer(arg0: torch.Tensor, arg1: Optional[torch.Tensor], arg2: int) -> Tensor"
    )
    monkeypatch.setattr(eagle_native, "draft_kernel", lambda d: (older, None))
    old = Eagle1DraftModel(native.drafter, target.lm_head_logits, target._head)
    assert (
        old._layer_native
        and not old._tree_native
        and "no full_mask" in old.native_plan["draft_layer"]
    )
    compared = 0
    for (_, lp1, id1), (_, lp2, id2) in zip(
        draft_calls(old, 64, 5), draft_calls(native, 64, 5), strict=True
    ):
        compared += assert_same_topk(lp1, id1, lp2, id2, atol=0.05)
    # root and chain natively, the tree in torch
    assert compared >= 10 and spy.calls == 2 and spy.tree_calls == 0


@needs_cpp
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize(
    "options",
    [
        {"policy": "chain", "depth": 3},
        {"policy": "tree", "total_tokens": 8, "depth": 3, "top_k": 3},
    ],
)
def test_speculative_greedy_with_native_drafting_is_plain_greedy(
    kind, options, target, monkeypatch
):
    prompt, new = [1, 5, 9, 300, 7], 24
    reference = generate_ar(target, prompt, new)
    native, slow = models(kind, target, monkeypatch)
    for model in (native, slow):
        proposer = EagleProposer(model, **options)
        assert proposer.draft_plan == model.native_plan
        res = SpeculativeDecoder(target, proposer).generate(prompt, new)
        assert res.tokens == reference and res.steps < new


def crippled_kernel(ext) -> types.SimpleNamespace:
    """An older build: ``linear`` and ``eagle3_layer`` only, a ``decoder_layer`` that needs ln1
    (never called)."""

    def decoder_layer(*args):
        raise AssertionError("decoder_layer must not run without ln1 support")

    decoder_layer.__doc__ = (
        "decoder_layer(arg0: torch.Tensor, arg1: torch.Tensor, arg2: torch.Tensor) -> Tensor"
    )
    return types.SimpleNamespace(
        linear=ext.linear, eagle3_layer=ext.eagle3_layer, decoder_layer=decoder_layer
    )


@needs_cpp
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_a_kernel_without_the_new_entry_points_falls_back_and_says_why(kind, target, monkeypatch):
    native, _ = models(kind, target, monkeypatch)
    monkeypatch.setattr(eagle_native, "draft_kernel", lambda d: (crippled_kernel(EXT), None))
    old = (
        Eagle1DraftModel(native.drafter, target.lm_head_logits, target._head)
        if kind == "eagle1"
        else Eagle3DraftModel(native.drafter)
    )
    assert "no norm_linear_topk" in old.native_plan["draft_head"]
    if kind == "eagle1":
        assert (
            old.native_plan["draft_layer"].startswith("torch: ")
            and "ln1" in old.native_plan["draft_layer"]
        )
        assert "ln1" in old.fused_reason and not old._layer_native
    compared = 0
    for (_, lp1, id1), (_, lp2, id2) in zip(
        draft_calls(old, 64, 5), draft_calls(native, 64, 5), strict=True
    ):
        compared += assert_same_topk(lp1, id1, lp2, id2, atol=0.05)
    assert compared >= 10


@needs_cpp
def test_the_eagle1_builder_shares_the_targets_packed_head(target, monkeypatch):
    """The EAGLE-1 proposer's native head reads the target's packed LM head (no second 2-byte x V x
    H copy)."""
    from draftsmith.runtime.drafting import eagle

    drafter = bf16_eagle1(target)
    monkeypatch.setattr(
        EagleDrafter, "from_export", classmethod(lambda cls, *a, **kw: (drafter, None))
    )
    proposer = eagle._build_eagle("unused", {"method": "eagle"}, target)
    packed = proposer.model._head_args[2]
    assert packed.data_ptr() == target._head.packed.data_ptr() and proposer.draft_plan[
        "draft_head"
    ].startswith("native" if HAS_TOPK else "linear in C++")
