"""The cost model describes the loop it is checked on: the verify curve anchored to the loop's plain
step, the per-step overhead refitted on the timed shapes' measured steps (prefill excluded), a
second round timing the shapes the refit ranks best. Every timing here reads a fake clock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_cost_model import OracleDrafter
from test_shape_choice import CostedModel, FakeClock
from test_speculative import tiny_llama

from draftsmith.runtime.acceptance.stop_policies import ConfidenceStop
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.chain import ChainProposer
from draftsmith.runtime.shapes import calibration, shape_timing
from draftsmith.runtime.shapes.cost_model import MachineCosts, anchor_curve, refit_overhead
from draftsmith.runtime.shapes.draft_shapes import Shape

pytestmark = pytest.mark.unit


def test_anchor_curve_keeps_the_shape_and_takes_the_loops_level():
    curve, scale = anchor_curve({1: 8.0, 2: 9.0, 16: 16.0}, ar_step_ms=6.0)
    assert scale == pytest.approx(0.75) and curve == pytest.approx({1: 6.0, 2: 6.75, 16: 12.0})
    assert anchor_curve({2: 9.0}, 6.0) == ({2: 9.0}, 1.0)  # no 1-token point: nothing to anchor on


def _timed(nodes: float, depth: int, a: float, b: float, costs: MachineCosts) -> dict:
    verify = costs.verify_at(round(nodes))
    step = verify + costs.draft_ms_per_depth * depth + a + b * nodes
    return {
        "shape": f"n{nodes}",
        "nodes": nodes,
        "verify_ms": verify,
        "depth": depth,
        "measured_step_ms": step,
    }


def test_refit_recovers_an_overhead_that_grows_with_the_nodes():
    costs = MachineCosts(
        7.0, {n: 7.0 + 0.4 * n for n in range(1, 17)}, draft_ms_per_depth=1.0, overhead_ms=2.1
    )
    # the calibration's 16-node step measured 0.5 + 0.1 * 16 = 2.1 ms; the timed 2/4/6-node shapes
    # follow the same line
    refit, points = refit_overhead(
        costs, 16.0, [_timed(n, d, 0.5, 0.1, costs) for n, d in ((2, 1), (4, 2), (6, 2))]
    )
    assert refit.overhead_ms == pytest.approx(0.5) and refit.overhead_per_node_ms == pytest.approx(
        0.1
    )
    assert [p["source"] for p in points] == ["calibration", "n2", "n4", "n6"]
    assert refit.rest_ms(1, 2.0) == pytest.approx(
        1.0 + 0.5 + 0.2
    )  # a chain:1 no longer pays a 16-node overhead
    assert (
        refit.verify_ms == costs.verify_ms and refit.draft_ms_per_depth == costs.draft_ms_per_depth
    )


def test_refit_never_makes_the_overhead_negative():
    costs = MachineCosts(
        7.0, {n: 7.0 for n in range(1, 17)}, draft_ms_per_depth=0.0, overhead_ms=0.2
    )
    falling, _ = refit_overhead(
        costs, 16.0, [_timed(2, 1, 3.0, 0.0, costs)]
    )  # small shapes dearer: slope < 0
    assert falling.overhead_per_node_ms == 0.0 and falling.overhead_ms == pytest.approx(
        1.6
    )  # their mean
    steep, _ = refit_overhead(
        costs, 16.0, [_timed(2, 1, 0.0, 0.0, costs), _timed(4, 1, 0.0, 0.0, costs)]
    )
    assert steep.overhead_ms >= 0.0 and steep.overhead_per_node_ms >= 0.0
    alone, _ = refit_overhead(costs, 16.0, [])
    assert alone.overhead_ms == pytest.approx(0.2) and alone.overhead_per_node_ms == 0.0


def test_timed_shapes_report_their_decode_step_without_the_prefill():
    _, lean = tiny_llama(0, layers=2, head_scale=8.0)
    prompt = [1, 5, 9]
    sequence = prompt + generate_ar(lean, prompt, 80)
    clock = FakeClock()
    costed = CostedModel(lean, clock, lambda n: 10.0 + 0.5 * n, prefill_ms=400.0)
    spec = SpeculativeDecoder(costed, ChainProposer(OracleDrafter(sequence, 96, 0), depth=4))
    timings = shape_timing.check_shapes(
        spec, spec.proposer, [Shape("depth", 2, 3)], [prompt, prompt], (), clock
    )
    # an oracle chain of depth 2 verifies 3 nodes a step: 11.5 ms, whatever the 400 ms prefill
    assert timings.step_ms["depth:2"] == pytest.approx(11.5)
    assert timings.speedup["depth:2"] > 1.0 and timings.noise == shape_timing.MIN_NOISE
    # the oracle's 2 drafts + the bonus (the last step cut)
    assert 2.8 < timings.tokens_per_step["depth:2"] <= 3.0
    assert timings.tokens_per_step["depth:2"] == pytest.approx(
        31 / 11
    )  # 31 tokens after the prefill's, 11 steps
    steps = 31 / timings.tokens_per_step["depth:2"]  # the prefill gives each side its first token
    assert timings.decode_speedup["depth:2"] == pytest.approx(
        31 * 10.5 / (steps * 11.5)
    )  # prefills out of both


def _oracle_runtime(layers: int) -> tuple[SimpleNamespace, list[int], FakeClock]:
    """A tiny target charging a fake clock 10 ms + 0.25 ms per new token (a 50 ms prefill), drafted
    for by a free oracle chain: (runtime, prompt, clock)."""
    _, lean = tiny_llama(0, layers=layers, head_scale=8.0)
    prompt = [1, 5, 9]
    sequence = prompt + generate_ar(lean, prompt, 120)
    clock = FakeClock()
    spec = SpeculativeDecoder(
        CostedModel(lean, clock, lambda n: 10.0 + 0.25 * n, prefill_ms=50.0),
        ChainProposer(OracleDrafter(sequence, 96, 0), depth=4),
        stop_policy=ConfidenceStop(0.1, max_depth=4),
    )
    runtime = SimpleNamespace(
        speculative=spec, model=lean, eos_ids=(), folder="tiny", export_config={"method": "t"}
    )
    return runtime, prompt, clock


def test_the_refitted_prediction_matches_the_loop_and_a_drifted_curve_is_anchored(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("DRAFTSMITH_COST_CACHE", str(tmp_path))
    runtime, prompt, clock = _oracle_runtime(layers=4)
    drifted = {
        n: 1.3 * (10.0 + 0.25 * n) for n in range(1, 17)
    }  # a curve timed while the machine ran slower
    _, record = calibration.choose_cost_aware_shape(runtime, [prompt, prompt], drifted, clock=clock)
    assert record["refit"]["curve_scale"] == pytest.approx(10.25 / 13.325)
    assert record["verify_ms_by_nodes"][1] == pytest.approx(record["ar_step_ms_decode_only"])
    timed = [r for r in record["table"] if r["measured_step_ms"] is not None]
    assert len(timed) >= 3 and all(r["predicted_speedup_calibration"] is not None for r in timed)
    for row in timed:  # drafting is free here, so the loop's step is the anchored verify forward
        assert row["step_ms"] == pytest.approx(row["measured_step_ms"], rel=0.03)


def test_the_bench_table_shows_prediction_and_measurement_side_by_side(tmp_path, monkeypatch):
    from draftsmith.bench.report_tables import shape_table

    monkeypatch.setenv("DRAFTSMITH_COST_CACHE", str(tmp_path))
    runtime, prompt, clock = _oracle_runtime(layers=2)
    _, record = calibration.choose_cost_aware_shape(runtime, [prompt, prompt], clock=clock)
    text = shape_table(record)
    timed = [
        r for r in record["table"] if r["measured_step_ms"] is not None and r["shape"] != "plain"
    ]
    row = next(line for line in text.splitlines() if line.startswith(f"| {timed[0]['shape']}"))
    assert f"({timed[0]['measured_step_ms']:.2f})" in row and " -> " in row
    assert "Overhead refitted on the timed steps" in text and "per node" in text


def test_round_two_times_only_new_shapes_with_a_prediction_of_their_own():
    rows = [
        {
            "shape": "plain",
            "spec": {"kind": "plain", "depth": 0, "nodes": 1, "branching": 1},
            "tokens": 1.0,
            "nodes": 1.0,
            "step_ms": 7.0,
        }
    ]
    for label, b, n, tokens in (
        ("tree:3/b2/d1", 2, 3, 1.43),
        ("tree:3/b4/d1", 4, 3, 1.43),
        ("tree:4/b3/d1", 3, 4, 1.49),
        ("tree:5/b4/d1", 4, 5, 1.54),
    ):
        rows.append(
            {
                "shape": label,
                "spec": {"kind": "tree", "depth": 1, "nodes": n, "branching": b},
                "tokens": tokens,
                "nodes": float(n),
                "step_ms": 9.0 + n / 4,
            }
        )
    # tree:3/b4/d1 predicts exactly as tree:3/b2/d1 (the cap never binds): it is not timed twice
    assert [s.label for s in calibration._top(rows, set())] == [
        "tree:3/b2/d1",
        "tree:4/b3/d1",
        "tree:5/b4/d1",
    ]
    assert [s.label for s in calibration._top(rows, {"tree:3/b2/d1", "tree:5/b4/d1"})] == [
        "tree:4/b3/d1"
    ]
    # nothing new: one round
    assert calibration._top(rows, {"tree:3/b2/d1", "tree:4/b3/d1", "tree:5/b4/d1"}) == []
    first = shape_timing.ShapeTimings({"a": 1.1}, 0.04, {"a": 9.0}, {"a": 1.5}, {"a": 1.2})
    both = first.merge(
        shape_timing.ShapeTimings({"b": 0.9}, 0.07, {"b": 11.0}, {"b": 1.6}, {"b": 0.95})
    )
    assert (
        both.speedup == {"a": 1.1, "b": 0.9}
        and both.noise == 0.07
        and both.step_ms == {"a": 9.0, "b": 11.0}
    )
    assert both.tokens_per_step == {"a": 1.5, "b": 1.6} and both.decode_speedup == {
        "a": 1.2,
        "b": 0.95,
    }


def test_one_more_node_costs_its_overhead_in_specdec_threshold():
    from draftsmith.runtime.shapes.cost_model import threshold_from_costs

    flat = MachineCosts(10.0, {1: 10.0, 2: 10.5, 3: 11.0}, draft_ms_per_depth=1.0)
    per_node = MachineCosts(
        10.0, {1: 10.0, 2: 10.5, 3: 11.0}, draft_ms_per_depth=1.0, overhead_per_node_ms=0.5
    )
    assert threshold_from_costs(flat) == pytest.approx(1.0 - 1.5 / 10.0)
    assert threshold_from_costs(per_node) == pytest.approx(1.0 - 2.0 / 10.0)
