"""The cost-aware shape choice: measure what the loop does on this machine (a verify forward of
every size 1..16 on a real cache, the plain decode step without its prefill, acceptance on
``CALIBRATION_PROMPTS x CALIBRATION_TOKENS`` tokens), predict every candidate shape (:mod:`shapes`,
:mod:`cost_model`), time the best few against plain decoding, serve the best measured one only when
it beats plain decoding by more than the measured noise, and cache the decision per machine and
export so ``generate`` reuses it. Every timer reads an injectable ``clock``."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from draftsmith.runtime.acceptance.stop_policies import LearnedStop
from draftsmith.runtime.decoding import metrics
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import Proposer
from draftsmith.runtime.shapes import draft_shapes
from draftsmith.runtime.shapes.cost_model import (
    MachineCosts,
    ShapeChoice,
    anchor_curve,
    decide_shape,
    predict_shapes,
    refit_overhead,
    threshold_from_costs,
)
from draftsmith.runtime.shapes.loop_profile import StepRecorder, calibrate, machine_costs
from draftsmith.runtime.shapes.shape_cache import cache_key, machine_identity, save_shape_choice
from draftsmith.runtime.shapes.shape_timing import CHECK_TOKENS, Clock, ShapeTimings, check_shapes
from draftsmith.runtime.shapes.target_timing import (
    VERIFY_SIZES,
    decode_step_ms,
    forward_curve,
    loop_head,
)

if TYPE_CHECKING:
    from draftsmith.runtime.serving import (
        Runtime,
    )  # the runtime imports no shape code: no cycle at run time

CALIBRATION_PROMPTS = 4  # prompts calibration drafts on (fewer when the bench has fewer)
# new tokens per calibration prompt: up to 256 target tokens, ~100 verified steps
CALIBRATION_TOKENS = 64
# fewer generated tokens than this (short outputs, early EOS): no calibration
MIN_CALIBRATION_TOKENS = 64
CHECK_TOP = 3  # predicted-best shapes timed against plain decoding


def _top(table: list[dict[str, Any]], skip: set[str]) -> list[draft_shapes.Shape]:
    """Up to ``CHECK_TOP`` shapes to time: the best predicted ones, going down ``table``, each with
    a prediction of its own (shapes whose caps never bind, e.g. tree:3/b2/d1 and tree:3/b4/d1,
    predict alike: the first stands for them); those among them already timed (``skip``) are left
    out, so round 2 may time none. Never plain decoding.
    """
    picked, seen = [], set()
    for row in table:
        signature = (round(row["tokens"], 6), round(row["nodes"], 6), round(row["step_ms"], 6))
        if row["shape"] == draft_shapes.PLAIN.label or signature in seen:
            continue
        seen.add(signature)
        picked.append(row)
        if len(picked) == CHECK_TOP:
            break
    return [draft_shapes.Shape.from_dict(r["spec"]) for r in picked if r["shape"] not in skip]


def _annotate(
    table: list[dict[str, Any]], first: list[dict[str, Any]], timings: ShapeTimings
) -> None:
    """Put on every row of the refitted ``table`` the calibration's prediction and what timing
    measured."""
    calibration_prediction = {r["shape"]: r["predicted_speedup"] for r in first}
    for row in table:
        row["predicted_speedup_calibration"] = calibration_prediction[row["shape"]]
        row["measured_step_ms"] = timings.step_ms.get(row["shape"])
        row["measured_tokens"] = timings.tokens_per_step.get(row["shape"])
        row["measured_decode_speedup"] = timings.decode_speedup.get(row["shape"])


def _timed_rows(table: list[dict[str, Any]], timings: ShapeTimings) -> list[dict[str, Any]]:
    """The predicted rows of the timed shapes with their measured decode step (for the overhead
    refit); a shape whose prefill estimate swallowed its whole time (step 0) says nothing and is
    left out."""
    return [
        {**r, "depth": r["spec"]["depth"], "measured_step_ms": timings.step_ms[r["shape"]]}
        for r in table
        if timings.step_ms.get(r["shape"], 0.0) > 0.0
    ]


def _serve_plain(
    runtime: Runtime, why: str, record: dict[str, Any]
) -> tuple[ShapeChoice, dict[str, Any]]:
    """Plain decoding because calibration could not run; cached like any decision."""
    choice = ShapeChoice(draft_shapes.PLAIN, f"{why}: serving plain decoding")
    draft_shapes.apply_shape(runtime.speculative, draft_shapes.PLAIN)
    path = save_shape_choice(
        cache_key(machine_identity(runtime)),
        MachineCosts(0.0, {1: 0.0}),
        choice,
        machine_identity(runtime),
    )
    return choice, {**record, **_decision(choice), "cache": str(path)}


def _decision(choice: ShapeChoice) -> dict[str, Any]:
    return {
        "shape": dataclasses.asdict(choice.shape),
        "shape_label": choice.shape.label,
        "depth": choice.depth,
        "why": choice.why,
        "summary": choice.summary(),
        "predicted_speedup": choice.predicted_speedup,
        "measured_speedup": choice.measured_speedup,
        "noise": choice.noise,
        "table": choice.table,
        "timed": [
            {k: r[k] for k in ("shape", "predicted_speedup", "measured_speedup")}
            for r in choice.table
            if r["measured_speedup"] is not None
        ],
    }


def choose_cost_aware_shape(
    runtime: Runtime,
    prompts: Sequence[list[int]],
    verify_ms: dict[int, float] | None = None,
    clock: Clock = time.perf_counter,
) -> tuple[ShapeChoice, dict[str, Any]]:
    """Calibrate, predict every candidate shape, time the best ``CHECK_TOP`` against plain decoding,
    refit the per-step overhead on their measured steps, time the shapes the refit now ranks best
    (round 2), apply the best measured one (or plain decoding) to ``runtime.speculative`` and cache
    the decision for this machine and export.
    ``verify_ms``: a measured forward-cost curve to reuse when it covers every size 1..16 (anchored
    to the plain step measured here). Returns the choice and a record for bench.json."""
    spec, base = runtime.speculative, runtime.speculative.proposer
    calib = [list(p) for p in prompts[:CALIBRATION_PROMPTS]]
    record: dict[str, Any] = {
        "calibration_prompts": len(calib),
        "calibration_tokens": CALIBRATION_TOKENS,
        "min_calibration_tokens": MIN_CALIBRATION_TOKENS,
        "learned_threshold": None,
    }
    if not calib:
        return _serve_plain(runtime, "no prompt to calibrate on", record)
    recorder, report, results = calibrate(
        spec, base, calib, CALIBRATION_TOKENS, runtime.eos_ids, clock
    )
    generated = sum(len(r.tokens) for r in results)
    record.update(calibration_generated_tokens=generated, calibration_steps=len(recorder.steps))
    if generated < MIN_CALIBRATION_TOKENS or not recorder.steps:
        return _serve_plain(
            runtime,
            f"cannot calibrate: {len(calib)} prompt(s) gave {generated} new tokens, fewer "
            f"than the {MIN_CALIBRATION_TOKENS} needed to measure acceptance (outputs too "
            "short)",
            record,
        )
    measured = _measure(spec, base, calib, recorder, report, verify_ms, clock)
    choice, costs, record["refit"] = _time_and_decide(
        spec, base, recorder, measured, calib, runtime.eos_ids, clock
    )
    if isinstance(
        spec.stop_policy, LearnedStop
    ):  # SpecDec++: its h from this machine's costs (the MDP threshold)
        record["learned_threshold"] = _learned_threshold(spec, costs)
    draft_shapes.apply_shape(spec, choice.shape, base)
    path = save_shape_choice(
        cache_key(machine_identity(runtime)), costs, choice, machine_identity(runtime)
    )
    record.update(
        acceptance_by_position=metrics.acceptance_by_position(
            [len(s.accepted) - 1 for s in recorder.steps], [max(s.depths) for s in recorder.steps]
        ),
        costs=dataclasses.asdict(costs),
        ar_step_ms_decode_only=measured.ar_ms,
        ar_step_ms_per_prompt=measured.ar_per_prompt,
        verify_ms_by_nodes=costs.verify_ms,
        candidates=len(choice.table) - 1,
        **_decision(choice),
        cache=str(path),
    )
    return choice, record


@dataclasses.dataclass
class _Measured:
    """The machine's costs as calibration measured them, before the refit on timed shapes."""

    costs: MachineCosts
    ar_ms: float  # the plain decode step without its prefill
    ar_per_prompt: list[float]
    curve_scale: float  # anchor_curve's scale of a reused verify curve
    raw_curve_1_token_ms: float | None


def _measure(
    spec: SpeculativeDecoder,
    base: Proposer,
    calib: list[list[int]],
    recorder: StepRecorder,
    report: dict[str, Any],
    verify_ms: dict[int, float] | None,
    clock: Clock,
) -> _Measured:
    """Time the verify curve (or reuse ``verify_ms`` when it covers every size) and the plain step
    with the loop's head; with the calibration's profile, the machine's costs."""
    head = loop_head(spec)
    raw_curve = (
        verify_ms
        if verify_ms and all(n in verify_ms for n in VERIFY_SIZES)
        else forward_curve(spec.model, calib[0], clock=clock, head=head)
    )
    ar_ms, ar_per_prompt = decode_step_ms(spec.model, calib, CHECK_TOKENS, clock, head=head)
    curve, scale = anchor_curve({int(n): float(v) for n, v in raw_curve.items()}, ar_ms)
    calibrated = machine_costs(recorder, report, base, ar_ms, curve)
    return _Measured(calibrated, ar_ms, ar_per_prompt, scale, raw_curve.get(1))


def _time_and_decide(
    spec: SpeculativeDecoder,
    base: Proposer,
    recorder: StepRecorder,
    measured: _Measured,
    calib: list[list[int]],
    eos_ids: Sequence[int],
    clock: Clock,
) -> tuple[ShapeChoice, MachineCosts, dict[str, Any]]:
    """Predict every candidate, time the best against plain decoding, refit the overhead and time
    the shapes the refit ranks best (round 2), then decide: (choice with its table, refitted costs,
    the refit's record)."""
    candidates = draft_shapes.candidates(base)

    def predict(costs: MachineCosts) -> list[dict[str, Any]]:
        return predict_shapes(
            recorder.steps, candidates, costs, lambda s: draft_shapes.static_paths_of(base, s)
        )

    first = predict(measured.costs)
    timings = check_shapes(spec, base, _top(first, set()), calib, eos_ids, clock)
    # Round 2: refit the overhead on the steps just measured; time the shapes that now rank best and
    # were not timed.
    costs, points = refit_overhead(
        measured.costs,
        sum(len(s.parents) for s in recorder.steps) / len(recorder.steps),
        _timed_rows(first, timings),
    )
    table = predict(costs)
    fresh = _top(table, set(timings.speedup))
    if fresh:
        timings = timings.merge(check_shapes(spec, base, fresh, calib, eos_ids, clock))
    _annotate(table, first, timings)
    choice = decide_shape(table, timings.speedup, timings.noise)
    choice.table = [r for r in table if r["shape"] == draft_shapes.PLAIN.label] + [
        r for r in table if r["shape"] != draft_shapes.PLAIN.label
    ]
    for row in choice.table:
        row["depth"] = row["spec"]["depth"]
    refit = {
        "curve_scale": measured.curve_scale,
        "raw_curve_1_token_ms": measured.raw_curve_1_token_ms,
        "points": points,
        "calibration_costs": dataclasses.asdict(measured.costs),
        "rounds": 2 if fresh else 1,
        "timed_in_round_2": [s.label for s in fresh],
    }
    return choice, costs, refit


def _learned_threshold(spec: SpeculativeDecoder, costs: MachineCosts) -> dict[str, Any]:
    """Set SpecDec++'s h from this machine's costs; what was done, for the record."""
    h = threshold_from_costs(costs)
    done = {
        "h": h,
        "was": spec.stop_policy.threshold,
        "why": (
            f"one more draft token costs {costs.draft_ms_per_depth:.2f} ms drafting + its marginal"
            f" verify vs a {costs.ar_step_ms:.2f} ms plain step: stop once P(rejection) > 1 - that"
            " ratio"
        ),
    }
    spec.stop_policy = dataclasses.replace(spec.stop_policy, threshold=h)
    return done
