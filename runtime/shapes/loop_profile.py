"""Calibration's run of the speculative loop: generations with a step profiler
(:func:`profiled_run`), every verified tree recorded with the path the verifier accepted
(:class:`StepRecorder`), and the machine's costs derived from both (:func:`machine_costs`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from draftsmith.runtime.acceptance.stop_policies import FixedDepth
from draftsmith.runtime.decoding.profile import StepProfiler
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import Proposer, ProposerWrapper, StepContext
from draftsmith.runtime.drafting.tree import DraftTree
from draftsmith.runtime.shapes import draft_shapes
from draftsmith.runtime.shapes.cost_model import MachineCosts
from draftsmith.runtime.shapes.shape_timing import Clock


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


def calibrate(
    spec: SpeculativeDecoder,
    base: Proposer,
    prompts: Sequence[list[int]],
    tokens: int,
    eos_ids: Sequence[int],
    clock: Clock,
) -> tuple[StepRecorder, dict[str, Any], list[Any]]:
    """Draft the family's superset shape (no fixed depth cap) on the prompts, ``tokens`` new tokens
    each: (recorder, profile report, results)."""
    recorder = StepRecorder(draft_shapes.calibration_proposer(base), clock)
    saved = spec.proposer, spec.stop_policy
    spec.proposer = recorder
    if isinstance(spec.stop_policy, FixedDepth):
        spec.stop_policy = None
    try:
        report, results, _ = profiled_run(spec, prompts, tokens, eos_ids, clock)
    finally:
        spec.proposer, spec.stop_policy = saved
    return recorder, report, results


def machine_costs(
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
