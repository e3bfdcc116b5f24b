"""The cost-aware shape choice: measure what the loop does on this machine (a verify forward of
every size 1..16 on a real cache, the plain decode step without its prefill, acceptance on
``CALIBRATION_PROMPTS x CALIBRATION_TOKENS`` tokens), predict every candidate shape (:mod:`shapes`,
:mod:`cost_model`), time the best few against plain decoding, serve the best measured one only when
it beats plain decoding by more than the measured noise, and cache the decision per machine and
export so ``generate`` reuses it. Every timer reads an injectable ``clock``."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from draftsmith.kernels import cpu_caps
from draftsmith.runtime.acceptance.stop_policies import FixedDepth, LearnedStop
from draftsmith.runtime.decoding import metrics
from draftsmith.runtime.decoding.profile import StepProfiler
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.decoding.threads import governor
from draftsmith.runtime.drafting.base import NullProposer, Proposer, ProposerWrapper, StepContext
from draftsmith.runtime.drafting.tree import DraftTree
from draftsmith.runtime.shapes import draft_shapes
from draftsmith.runtime.shapes.cost_model import (
    MachineCosts,
    ShapeChoice,
    anchor_curve,
    cache_key,
    decide_shape,
    load_choice,
    predict_shapes,
    refit_overhead,
    save_shape_choice,
    threshold_from_costs,
)
from draftsmith.runtime.shapes.shape_timing import CHECK_TOKENS, Clock, ShapeTimings, check_shapes
from draftsmith.runtime.target.interface import TargetDecoder

if TYPE_CHECKING:
    from draftsmith.runtime.serving import (
        Runtime,
    )  # the runtime imports no shape code: no cycle at run time

CALIBRATION_PROMPTS = 4  # prompts calibration drafts on (fewer when the bench has fewer)
CALIBRATION_TOKENS = (
    64  # new tokens per calibration prompt: up to 256 target tokens, ~100 verified steps
)
MIN_CALIBRATION_TOKENS = (
    64  # fewer generated tokens than this (short outputs, early EOS): no calibration
)
VERIFY_SIZES = tuple(
    range(1, draft_shapes.MAX_NODES + 1)
)  # every forward size a candidate can verify
CHECK_TOP = 3  # predicted-best shapes timed against plain decoding


def profiled_run(
    spec: SpeculativeDecoder,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    clock: Clock = time.perf_counter,
) -> tuple[dict[str, Any], list[Any], StepProfiler]:
    """Greedy-seeded generations of ``prompts`` with a profiler attached: (profile report, results,
    profiler)."""
    prof = StepProfiler(spec.model.device, clock)
    spec.profiler = prof
    try:
        results = [
            spec.generate(
                p, max_new_tokens, eos_ids=eos_ids, generator=torch.Generator().manual_seed(i)
            )
            for i, p in enumerate(prompts)
        ]
    finally:
        spec.profiler = None
    return prof.report(), results, prof


def machine_identity(runtime: Runtime) -> dict[str, Any]:
    """What the measured costs depend on: CPU, threads, target, dtype, linear backend, the drafter
    export."""
    return {
        "cpu": cpu_caps.probe().describe(),
        "threads": torch.get_num_threads(),
        "target": runtime.folder,
        "dtype": str(runtime.model.dtype),
        "linears": runtime.model.linear_ops,
        "export": (
            (runtime.export_config or {}).get("fingerprint")
            or (runtime.export_config or {}).get("target")
        ),
        "method": (runtime.export_config or {}).get("method"),
    }


def loop_head(spec: SpeculativeDecoder | None) -> str:
    """The LM head the decode loops run: "argmax" where greedy verification (and so greedy plain
    decoding) reduces it to an argmax per row without [N, V] logits, else "logits". Costs are timed
    with this head: timed with the logits head, the embedded 135M target's plain step read 9.7 ms
    where the loop's timing implied about 8.4 ms, and every predicted speedup came out about 14%
    high (docs/notebook/MEASUREMENTS.md section 17)."""
    return "argmax" if spec is not None and spec.uses_argmax_head() else "logits"


def forward_curve(
    model: TargetDecoder,
    prompt: list[int],
    sizes: Sequence[int] = VERIFY_SIZES,
    repeats: int = 3,
    clock: Clock = time.perf_counter,
    head: str = "logits",
) -> dict[int, float]:
    """ms of one forward of ``n`` new tokens (a causal tree mask, as a verify step) after ``prompt``
    on a real KV cache, for every ``n`` in ``sizes`` (median of ``repeats``; the cache is not
    advanced), with the LM ``head`` the loop runs (:func:`loop_head`)."""
    device = model.device
    cache = model.allocate_cache(len(prompt) + max(sizes) + 1)
    with torch.inference_mode():
        model.forward(torch.tensor(prompt, device=device), cache, logits_for="last")
        cache.commit(len(prompt))

        def one(n: int) -> float:
            ids = torch.full((n,), int(prompt[-1]), device=device)
            mask = torch.ones(n, n, dtype=torch.bool, device=device).tril() if n > 1 else None
            # the threads the loops would run with now (a busy machine lends fewer)
            governor().tick()
            start = clock()
            model.forward(ids, cache, tree_mask=mask, logits_for="all", head=head)
            return 1e3 * (clock() - start)

        one(1)  # warm-up
        return {int(n): statistics.median(one(int(n)) for _ in range(repeats)) for n in sizes}


def decode_step_ms(
    model: TargetDecoder,
    prompts: Sequence[list[int]],
    tokens: int,
    clock: Clock = time.perf_counter,
    head: str = "logits",
) -> tuple[float, list[float]]:
    """The plain decode step WITHOUT the prefill: greedy steps after an untimed prefill of each
    prompt, with the LM ``head`` the loop runs (:func:`loop_head`). Returns (mean ms per step over
    every prompt, ms per step of each prompt)."""
    device = model.device
    per_prompt = []
    with torch.inference_mode():
        for prompt in prompts:
            cache = model.allocate_cache(len(prompt) + tokens + 1)
            logits = model.forward(
                torch.tensor(prompt, device=device), cache, logits_for="last"
            ).logits
            cache.commit(len(prompt))
            step = logits[-1].argmax().reshape(1)  # [1]
            spent = 0.0
            for _ in range(tokens):
                governor().tick()  # as the plain loop does
                start = clock()
                out = model.forward(step, cache, logits_for="last", head=head)
                cache.commit(1)
                spent += clock() - start
                step = (out.argmax if head == "argmax" else out.logits[-1].argmax()).reshape(1)
            per_prompt.append(1e3 * spent / tokens)
    return sum(per_prompt) / len(per_prompt), per_prompt


class StepRecorder(ProposerWrapper):
    """Wraps the calibration proposer: times ``propose`` with the clock and records every verified
    tree with the path the verifier accepted
    (:class:`~draftsmith.runtime.shapes.draft_shapes.RecordedStep`)."""

    def __init__(self, inner: Proposer, clock: Clock) -> None:
        super().__init__(inner)
        self.clock = clock
        self.steps: list[draft_shapes.RecordedStep] = []
        self.draft_s, self._tree = 0.0, None

    def propose(self, ctx: StepContext) -> DraftTree:
        """Draft with the inner proposer, timed."""
        start = self.clock()
        self._tree = self.inner.propose(ctx)
        self.draft_s += self.clock() - start
        return self._tree

    def accept(self, ctx: StepContext) -> None:
        """Record the verified tree and its accepted path, then tell the inner proposer."""
        self.steps.append(draft_shapes.record_step(self._tree, ctx.acceptance.path_nodes))
        self.inner.accept(ctx)


def _calibrate(
    spec: SpeculativeDecoder,
    base: Proposer,
    prompts: Sequence[list[int]],
    eos_ids: Sequence[int],
    clock: Clock,
) -> tuple[StepRecorder, dict[str, Any], list[Any]]:
    """Draft the family's superset shape (no fixed depth cap) on the prompts: (recorder, profile
    report, results)."""
    recorder = StepRecorder(draft_shapes.calibration_proposer(base), clock)
    saved = spec.proposer, spec.stop_policy
    spec.proposer = recorder
    if isinstance(spec.stop_policy, FixedDepth):
        spec.stop_policy = None
    try:
        report, results, _ = profiled_run(spec, prompts, CALIBRATION_TOKENS, eos_ids, clock)
    finally:
        spec.proposer, spec.stop_policy = saved
    return recorder, report, results


def _machine_costs(
    recorder: StepRecorder,
    report: dict[str, Any],
    base: Proposer,
    ar_ms: float,
    curve: dict[int, float],
) -> MachineCosts:
    """Costs from the calibration: drafting per step (per depth level, or fixed for static trees),
    the per-step rest besides the verify forward (profiled), the measured verify curve and the
    decode-only AR step."""
    steps = max(1, len(recorder.steps))
    draft_ms = 1e3 * recorder.draft_s / steps
    overhead = (
        report["verification_ms"]
        + report["kv_compaction_ms"]
        + report["proposer_update_ms"]
        + max(0.0, report["unattributed_ms"])
    )
    if draft_shapes.family_of(base) == "static_tree":
        return MachineCosts(ar_ms, curve, 0.0, overhead, draft_ms)
    mean_depth = sum(max(s.depths) for s in recorder.steps) / steps
    return MachineCosts(ar_ms, curve, draft_ms / max(mean_depth, 1.0), overhead)


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
    recorder, report, results = _calibrate(spec, base, calib, runtime.eos_ids, clock)
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
    head = loop_head(spec)
    raw_curve = (
        verify_ms
        if verify_ms and all(n in verify_ms for n in VERIFY_SIZES)
        else forward_curve(spec.model, calib[0], clock=clock, head=head)
    )
    ar_ms, ar_per_prompt = decode_step_ms(spec.model, calib, CHECK_TOKENS, clock, head=head)
    curve, scale = anchor_curve({int(n): float(v) for n, v in raw_curve.items()}, ar_ms)
    calibrated = _machine_costs(recorder, report, base, ar_ms, curve)
    candidates = draft_shapes.candidates(base)

    def predict(costs: MachineCosts) -> list[dict[str, Any]]:
        return predict_shapes(
            recorder.steps, candidates, costs, lambda s: draft_shapes.static_paths_of(base, s)
        )

    first = predict(calibrated)
    timings = check_shapes(spec, base, _top(first, set()), calib, runtime.eos_ids, clock)
    # Round 2: refit the overhead on the steps just measured; time the shapes that now rank best and
    # were not timed.
    costs, points = refit_overhead(
        calibrated,
        sum(len(s.parents) for s in recorder.steps) / len(recorder.steps),
        _timed_rows(first, timings),
    )
    table = predict(costs)
    fresh = _top(table, set(timings.speedup))
    if fresh:
        timings = timings.merge(check_shapes(spec, base, fresh, calib, runtime.eos_ids, clock))
    _annotate(table, first, timings)
    choice = decide_shape(table, timings.speedup, timings.noise)
    choice.table = [r for r in table if r["shape"] == draft_shapes.PLAIN.label] + [
        r for r in table if r["shape"] != draft_shapes.PLAIN.label
    ]
    for row in choice.table:
        row["depth"] = row["spec"]["depth"]
    record["refit"] = {
        "curve_scale": scale,
        "raw_curve_1_token_ms": raw_curve.get(1),
        "points": points,
        "calibration_costs": dataclasses.asdict(calibrated),
        "rounds": 2 if fresh else 1,
        "timed_in_round_2": [s.label for s in fresh],
    }
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
        ar_step_ms_decode_only=ar_ms,
        ar_step_ms_per_prompt=ar_per_prompt,
        verify_ms_by_nodes=costs.verify_ms,
        candidates=len(table) - 1,
        **_decision(choice),
        cache=str(path),
    )
    return choice, record


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


def apply_cached_shape(runtime: Runtime) -> str:
    """Apply the shape ``draftsmith bench`` chose for this machine and export (cached), or keep the
    export's own when it never ran here. Returns what was done, for the user."""
    cached = load_choice(cache_key(machine_identity(runtime)))
    if cached is None:
        return (
            "not calibrated on this machine: the export's stop policy runs (draftsmith bench"
            " calibrates it)"
        )
    if "shape" not in cached:  # a decision cached before shapes: a depth
        apply_depth(runtime.speculative, int(cached["depth"]))
        return f"draft depth {cached['depth']} (calibrated by draftsmith bench)"
    shape = draft_shapes.Shape.from_dict(cached["shape"])
    draft_shapes.apply_shape(runtime.speculative, shape)
    if shape.kind == "plain":
        return f"{cached['why']} (--stop-policy export forces the export's policy)"
    return f"draft shape {shape.label}: {cached['why']} (calibrated by draftsmith bench)"


def apply_depth(spec: SpeculativeDecoder, depth: int) -> None:
    """Cap the draft depth at ``depth`` (keeping the policy's own rule), or serve plain decoding for
    0."""
    if depth == 0:
        spec.proposer = NullProposer()
        return
    policy = spec.stop_policy
    spec.stop_policy = (
        FixedDepth(depth)
        if policy is None
        else dataclasses.replace(policy, max_depth=min(depth, policy.max_depth))
    )
