"""Shapes, not depths: candidate shapes, accepted length of a shape on recorded steps, the measured
verify curve and decode step (prefill excluded), the decision on measured speeds, refused shapes and
the cached shape reapplied. Every timing here reads a fake clock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_speculative import tiny_llama

from draftsmith.runtime.acceptance.stop_policies import FixedDepth
from draftsmith.runtime.drafting.base import Proposer
from draftsmith.runtime.drafting.medusa import MedusaProposer
from draftsmith.runtime.shapes import calibration, draft_shapes, shape_cache, target_timing
from draftsmith.runtime.shapes.cost_model import (
    MachineCosts,
    ShapeChoice,
    decide_shape,
    predict_shapes,
)
from draftsmith.runtime.shapes.draft_shapes import RecordedStep, Shape, ShapeError
from draftsmith.runtime.shapes.shape_cache import save_shape_choice
from draftsmith.runtime.target.interface import TargetWrapper

pytestmark = pytest.mark.unit

CPU_CURVE = {
    1: 5.6,
    2: 5.6,
    4: 6.4,
    8: 9.3,
    16: 15.0,
}  # the forward ms of 1/2/4/8/16 new tokens


class FakeClock:
    """Seconds that move only when a costed forward says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CostedModel(TargetWrapper):
    """The tiny target charging the fake clock per forward: a prefill (several tokens, no tree mask)
    costs ``prefill_ms``, a forward of n new tokens ``cost(n)`` ms."""

    def __init__(self, model, clock, cost, prefill_ms=500.0) -> None:
        super().__init__(model)
        self.model, self.clock, self.cost, self.prefill_ms = model, clock, cost, prefill_ms

    def forward(self, ids, cache, *args, **kwargs):
        n = ids.numel()
        prefill = n > 1 and kwargs.get("tree_mask") is None
        self.clock.now += (self.prefill_ms if prefill else self.cost(n)) / 1e3
        return self.model.forward(ids, cache, *args, **kwargs)


def test_verify_curve_covers_every_size_and_the_ar_step_excludes_the_prefill():
    _, lean = tiny_llama(0, layers=2)
    clock = FakeClock()
    model = CostedModel(lean, clock, lambda n: 5.0 + 0.5 * n, prefill_ms=900.0)
    curve = target_timing.forward_curve(model, [1, 5, 9], clock=clock)
    assert sorted(curve) == list(range(1, 17))
    assert curve == pytest.approx({n: 5.0 + 0.5 * n for n in range(1, 17)})
    step, per_prompt = target_timing.decode_step_ms(model, [[1, 5, 9], [2, 4, 6, 8]], 8, clock)
    assert step == pytest.approx(5.5) and per_prompt == pytest.approx(
        [5.5, 5.5]
    )  # the 900 ms prefill is not in it


class HeadRecorder(CostedModel):
    """A costed model that also records the LM head and the first input token of each forward."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.heads: list[str] = []
        self.fed: list[int] = []

    def forward(self, ids, cache, *args, **kwargs):
        self.heads.append(kwargs.get("head", "logits"))
        self.fed.append(int(ids[0]))
        return super().forward(ids, cache, *args, **kwargs)


def test_costs_are_timed_with_the_lm_head_the_loop_runs():
    """Greedy verification reduces the LM head to an argmax per row, and so does greedy plain
    decoding: the plain step and the verify curve are timed with that head (the logits head cost 14%
    more a step on a 135M target), and the argmax-head steps decode the same tokens as the
    logits-head steps."""
    _, lean = tiny_llama(0, layers=2)
    assert target_timing.loop_head(SimpleNamespace(uses_argmax_head=lambda: True)) == "argmax"
    assert target_timing.loop_head(SimpleNamespace(uses_argmax_head=lambda: False)) == "logits"
    # no speculative decoder: the logits head, as before
    assert target_timing.loop_head(None) == "logits"
    model = HeadRecorder(lean, FakeClock(), lambda n: 5.0)
    target_timing.forward_curve(model, [1, 5, 9], sizes=(1, 4), repeats=1, head="argmax")
    # the untimed prefill, the warm-up, then sizes 1 and 4
    assert model.heads == ["logits"] + ["argmax"] * 3
    fed = {}
    for head in ("argmax", "logits"):
        model = HeadRecorder(lean, FakeClock(), lambda n: 5.0)
        target_timing.decode_step_ms(model, [[2, 4, 6, 8]], 6, head=head)
        assert model.heads == ["logits"] + [head] * 6  # the untimed prefill, then each timed step
        fed[head] = model.fed[1:]
    assert fed["argmax"] == fed["logits"]  # the same greedy tokens either way


def _eagle_like_tree() -> tuple[list[int], list[int], list[float]]:
    """A 16-node tree 4 levels deep: the best node of each level has 4 children (3 at depth 4),
    ranked 0..3 with confidences 0.6, 0.2, 0.1, 0.05."""
    parents, depths, conf = [-1], [0], [1.0]
    best = 0
    for level, width in enumerate((4, 4, 4, 3), start=1):
        first = len(parents)
        for r in range(width):
            parents.append(best)
            depths.append(level)
            conf.append([0.6, 0.2, 0.1, 0.05][r])
        best = first
    return parents, depths, conf


def _chain_path(parents: list[int], length: int) -> list[int]:
    """Root, then the rank-0 child ``length`` times (the first child of each node in a BFS tree)."""
    path = [0]
    for _ in range(length):
        path.append(parents.index(path[-1]))
    return path


def _decaying_steps() -> list[RecordedStep]:
    """Ten steps accepting 0,0,0,0,1,1,1,2,2,3 rank-0 tokens: acceptance decays with depth."""
    parents, depths, conf = _eagle_like_tree()
    return [
        RecordedStep(parents, depths, conf, _chain_path(parents, a))
        for a in (0, 0, 0, 0, 1, 1, 1, 2, 2, 3)
    ]


def test_accepted_length_of_a_shape_on_a_recorded_tree():
    step = _decaying_steps()[-1]  # 3 rank-0 tokens accepted
    assert draft_shapes.accepted_length(step, Shape.chain(1)) == (1, 2)
    assert draft_shapes.accepted_length(step, Shape.chain(4))[0] == 3
    assert draft_shapes.accepted_length(step, Shape("tree", 2, 6, 2)) == (
        2,
        5,
    )  # only 4 recorded nodes fit b2/d2
    assert draft_shapes.accepted_length(step, Shape("depth", 2, 3)) == (
        2,
        len([d for d in step.depths if d <= 2]),
    )


def test_search_picks_a_short_chain_when_verify_16_is_dear_and_acceptance_decays():
    curve = {
        n: CPU_CURVE[n] if n in CPU_CURVE else MachineCosts(5.6, CPU_CURVE).verify_at(n)
        for n in range(1, 17)
    }
    costs = MachineCosts(5.6, curve, draft_ms_per_depth=0.3, overhead_ms=0.3)
    proposer = declared(shape_family="dynamic_tree", shape_vocab=100)
    table = predict_shapes(_decaying_steps(), draft_shapes.candidates(proposer), costs)
    assert table[0]["spec"]["kind"] == "chain" and 2 <= table[0]["spec"]["nodes"] <= 4
    full = next(r for r in table if r["shape"] == "tree:16/b4/d4")
    # the export's 16-node tree loses
    assert full["predicted_speedup"] < 1.0 < table[0]["predicted_speedup"]
    measured = {r["shape"]: r["predicted_speedup"] for r in table[:3] if r["shape"] != "plain"}
    choice = decide_shape(table, measured, noise=0.05)
    assert (
        choice.shape.kind == "chain" and 2 <= choice.shape.nodes <= 4 and "serving it" in choice.why
    )


def test_plain_decoding_when_measured_speed_disagrees_with_the_prediction_beyond_noise():
    costs = MachineCosts(5.6, {n: 5.6 + 0.1 * n for n in range(1, 17)}, 0.3, 0.3)
    proposer = declared(shape_family="dynamic_tree", shape_vocab=100)
    table = predict_shapes(_decaying_steps(), draft_shapes.candidates(proposer), costs)
    best = table[0]["shape"]
    assert table[0]["predicted_speedup"] > 1.2
    slower = decide_shape([dict(r) for r in table], {best: 0.92}, noise=0.05)
    assert (
        slower.speculation_loses and "does not beat runtime AR by more than the noise" in slower.why
    )
    within_noise = decide_shape([dict(r) for r in table], {best: 1.04}, noise=0.05)
    assert within_noise.shape == draft_shapes.PLAIN
    beyond = decide_shape([dict(r) for r in table], {best: 1.2}, noise=0.05)
    assert beyond.shape.label == best and beyond.measured_speedup == 1.2
    assert next(r for r in beyond.table if r["shape"] == best)["measured_speedup"] == 1.2


def test_shapes_that_cannot_run_are_refused():
    with pytest.raises(ShapeError, match="drafts no node"):
        Shape("chain", 0, 1)
    with pytest.raises(ShapeError, match="drafts no node"):
        Shape("tree", 2, 1, 2)
    with pytest.raises(ShapeError, match="do not fit"):
        Shape("tree", 2, 16, 2)  # 2 levels of branching 2 hold 7 nodes
    tiny_vocab = declared(shape_family="dynamic_tree", shape_vocab=3)
    with pytest.raises(ShapeError, match="larger than the drafter's vocabulary"):
        draft_shapes.with_shape(tiny_vocab, Shape("tree", 2, 6, 4))
    assert all(s.branching <= 3 for s in draft_shapes.candidates(tiny_vocab))
    with pytest.raises(ShapeError, match="only its depth"):
        draft_shapes.with_shape(declared(max_tree_nodes=5), Shape.chain(2))


class Heads(torch.nn.Module):
    """Three Medusa heads over a 96-token vocabulary (never run here)."""

    config = SimpleNamespace(num_heads=3, vocab_size=96)


def test_medusa_shapes_come_from_the_tree_builder():
    medusa = MedusaProposer(Heads(), [[0], [1], [0, 0]], top_k=2)
    shaped = draft_shapes.with_shape(medusa, Shape("tree", 2, 6, 2))
    from draftsmith.common.trees import default_medusa_tree

    assert sorted(map(list, shaped.tree.paths)) == sorted(default_medusa_tree(2, 5, 2))
    # a copy: the export's proposer is unchanged
    assert shaped.max_tree_nodes == 6 and medusa.max_tree_nodes == 4
    chain = draft_shapes.with_shape(medusa, Shape.chain(3))
    assert [list(p) for p in chain.tree.paths] == [[0], [0, 0], [0, 0, 0]]
    with pytest.raises(ShapeError, match="3 heads"):
        draft_shapes.with_shape(medusa, Shape.chain(4))


def declared(**members) -> Proposer:
    """A proposer declaring ``members`` (every other member keeps the base's default)."""
    return type("Declared", (Proposer,), members)()


class StubEagle(Proposer):
    """A dynamic-tree proposer that only records its options."""

    shape_family, shape_vocab, max_tree_nodes = "dynamic_tree", 100, 16

    def __init__(self) -> None:
        self.options: dict = {}

    def reshape(self, options: dict) -> None:
        self.options = dict(options)
        self.max_tree_nodes = (
            options["depth"] + 2 if options["policy"] == "chain" else options["total_tokens"]
        )


def _runtime(proposer) -> SimpleNamespace:
    spec = SimpleNamespace(proposer=proposer, stop_policy=None)
    model = SimpleNamespace(
        dtype=torch.float32, linear_ops="dense"
    )  # what machine_identity reads of a target
    return SimpleNamespace(
        speculative=spec, model=model, folder="tiny", export_config={"method": "eagle3"}
    )


def test_generate_reapplies_the_cached_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_COST_CACHE", str(tmp_path))
    bench_rt = _runtime(StubEagle())
    choice = ShapeChoice(
        Shape.chain(2), "chain:2 measured at 1.30x runtime AR: serving it", 1.4, 1.3, 0.05
    )
    save_shape_choice(
        shape_cache.cache_key(shape_cache.machine_identity(bench_rt)),
        MachineCosts(5.0, {1: 5.0}),
        choice,
        shape_cache.machine_identity(bench_rt),
    )
    rt = _runtime(StubEagle())
    note = shape_cache.apply_cached_shape(rt)  # what cli/serving.py's generate calls
    assert "chain:2" in note
    assert rt.speculative.proposer.options == {"policy": "chain", "depth": 1}
    assert (
        rt.speculative.stop_policy == FixedDepth(2) and rt.speculative.proposer.max_tree_nodes == 3
    )
    plain = ShapeChoice(draft_shapes.PLAIN, "best measured shape ... serving plain decoding")
    save_shape_choice(
        shape_cache.cache_key(shape_cache.machine_identity(bench_rt)),
        MachineCosts(5.0, {1: 5.0}),
        plain,
        shape_cache.machine_identity(bench_rt),
    )
    rt = _runtime(StubEagle())
    assert "plain decoding" in shape_cache.apply_cached_shape(rt)
    assert type(rt.speculative.proposer).__name__ == "NullProposer"


def test_a_model_that_cannot_calibrate_serves_plain_decoding_and_says_why(tmp_path, monkeypatch):
    from test_cost_model import OracleDrafter

    from draftsmith.runtime.decoding.autoregressive import generate_ar
    from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
    from draftsmith.runtime.drafting.chain import ChainProposer

    monkeypatch.setenv("DRAFTSMITH_COST_CACHE", str(tmp_path))
    _, lean = tiny_llama(0, layers=2, head_scale=8.0)
    prompt = [1, 5, 9]
    sequence = prompt + generate_ar(lean, prompt, 8)
    spec = SpeculativeDecoder(lean, ChainProposer(OracleDrafter(sequence, 96, 0), depth=4))
    runtime = SimpleNamespace(
        speculative=spec,
        model=lean,
        eos_ids=(sequence[4],),
        folder="tiny",
        export_config={"method": "t"},
    )  # every output ends after 2 tokens
    choice, record = calibration.choose_cost_aware_shape(
        runtime, [prompt, prompt], clock=FakeClock()
    )
    assert (
        choice.speculation_loses
        and "cannot calibrate" in choice.why
        and "too short" in record["why"]
    )
    assert record["calibration_generated_tokens"] < calibration.MIN_CALIBRATION_TOKENS
    assert spec.serves_plain_ar()
