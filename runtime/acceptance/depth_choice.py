"""The cost-aware depth choice: calibrate on a few prompts, predict every depth with :mod:`cost_model`, apply the
fastest (plain decoding included), and cache the decision per machine and export so ``generate`` reuses it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from draftsmith.kernels import cpu_caps
from draftsmith.runtime.acceptance.cost_model import (
    DepthChoice,
    MachineCosts,
    cache_key,
    choose_depth,
    load_choice,
    save_choice,
    threshold_from_costs,
)
from draftsmith.runtime.acceptance.stop_policies import FixedDepth, LearnedStop
from draftsmith.runtime.decoding import metrics
from draftsmith.runtime.decoding.profile import StepProfiler
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import NullProposer

CALIBRATION_PROMPTS = 2
CALIBRATION_TOKENS = 48


def profiled_run(spec: SpeculativeDecoder, prompts: Sequence[list[int]], max_new_tokens: int,
                 eos_ids: Sequence[int]) -> tuple[dict[str, Any], list[Any], StepProfiler]:
    """Greedy-seeded generations of ``prompts`` with a profiler attached: (profile report, results, profiler)."""
    prof = StepProfiler(getattr(spec.model, "device", "cpu"))
    spec.profiler = prof
    try:
        results = [spec.generate(p, max_new_tokens, eos_ids=eos_ids, generator=torch.Generator().manual_seed(i))
                   for i, p in enumerate(prompts)]
    finally:
        spec.profiler = None
    return prof.report(), results, prof


def costs_from_profile(report: dict[str, Any], mean_depth: float, ar_step_ms: float,
                       verify_ms: dict[int, float]) -> MachineCosts:
    """Machine costs from a profiled run: drafting per depth level, the per-step rest besides the verify forward."""
    overhead = report["verification_ms"] + report["kv_compaction_ms"] + report["proposer_update_ms"] + \
        max(0.0, report["unattributed_ms"])
    return MachineCosts(ar_step_ms, verify_ms, report["draft_ms"] / max(mean_depth, 1e-9), overhead)


def machine_identity(runtime: Any) -> dict[str, Any]:
    """What the measured costs depend on: CPU, threads, target, dtype, linear backend, the drafter export."""
    return {"cpu": cpu_caps.probe().describe(), "threads": torch.get_num_threads(), "target": runtime.folder,
            "dtype": str(runtime.model.dtype), "linears": getattr(runtime.model, "linear_ops", "hf"),
            "export": (runtime.export_config or {}).get("fingerprint") or (runtime.export_config or {}).get("target"),
            "method": (runtime.export_config or {}).get("method")}


def choose_cost_aware_depth(runtime: Any, prompts: Sequence[list[int]], ar_step_ms: float,
                            verify_ms: dict[int, float]) -> tuple[DepthChoice, dict[str, Any]]:
    """Calibrate on the first prompts at the export's full depth, predict every depth, apply the fastest to
    ``runtime.speculative`` (a capped stop policy, or the null proposer when speculation is predicted to lose) and
    cache the decision for this machine. Returns the choice and a record for bench.json."""
    spec = runtime.speculative
    calib = list(prompts[:CALIBRATION_PROMPTS])
    report, results, prof = profiled_run(spec, calib, CALIBRATION_TOKENS, runtime.eos_ids)
    accepted = [a for r in results for a in r.accepted_per_step]
    depths = [d for r in results for d in r.depths]
    acceptance = metrics.acceptance_by_position(accepted, depths)
    costs = costs_from_profile(report, sum(depths) / max(1, len(depths)), ar_step_ms, verify_ms)
    nodes = prof_nodes_by_depth(results)
    choice = choose_depth(acceptance, costs, lambda k: nodes(k))
    learned = None
    if isinstance(spec.stop_policy, LearnedStop):  # SpecDec++: its h from this machine's costs (the MDP threshold)
        h = threshold_from_costs(costs)
        learned = {"h": h, "was": spec.stop_policy.threshold,
                   "why": f"one more draft token costs {costs.draft_ms_per_depth:.2f} ms drafting + its marginal "
                          f"verify vs a {costs.ar_step_ms:.2f} ms plain step: stop once P(rejection) > 1 - that ratio"}
        spec.stop_policy = dataclasses.replace(spec.stop_policy, threshold=h)
    apply_depth(spec, choice.depth)
    key = cache_key(machine_identity(runtime))
    path = save_choice(key, costs, acceptance, choice, machine_identity(runtime))
    record = {"calibration_prompts": len(calib), "calibration_tokens": CALIBRATION_TOKENS,
              "acceptance_by_position": acceptance, "costs": dataclasses.asdict(costs), "table": choice.table,
              "depth": choice.depth, "predicted_speedup": choice.predicted_speedup, "summary": choice.summary(),
              "learned_threshold": learned,
              "cache": str(path)}
    return choice, record


def apply_cached_depth(runtime: Any) -> str:
    """Apply the depth ``draftsmith bench`` chose for this machine and export (cached), or keep the export's
    policy when it never ran here. Returns what was done, for the user."""
    cached = load_choice(cache_key(machine_identity(runtime)))
    if cached is None:
        return "not calibrated on this machine: the export's stop policy runs (draftsmith bench calibrates it)"
    apply_depth(runtime.speculative, int(cached["depth"]))
    if int(cached["depth"]) == 0:
        return (f"speculation was measured to lose on this machine (best predicted "
                f"{max((r['speedup'] for r in cached['table'] if r['depth'] > 0), default=0.0):.2f}x): plain decoding "
                "(--stop-policy export forces the export's policy)")
    return (f"draft depth {cached['depth']} (predicted {cached['predicted_speedup']:.2f}x, "
            "calibrated by draftsmith bench)")


def prof_nodes_by_depth(results: Sequence[Any]) -> Any:
    """``nodes(K)``: mean tree nodes up to depth K over the calibration steps (root included). Steps record only
    their size and deepest position, so a node count per depth is spread evenly over a step's depths."""
    per_depth: dict[int, list[float]] = {}
    for r in results:
        for size, depth in zip(r.tree_sizes, r.depths):
            for k in range(1, depth + 1):
                per_depth.setdefault(k, []).append(1 + (size - 1) * k / depth)

    def nodes(k: int) -> int:
        seen = per_depth.get(k)
        return max(k + 1, round(sum(seen) / len(seen))) if seen else k + 1

    return nodes


def apply_depth(spec: SpeculativeDecoder, depth: int) -> None:
    """Cap the draft depth at ``depth`` (keeping the policy's own rule), or serve plain decoding for 0."""
    if depth == 0:
        spec.proposer = NullProposer()
        return
    policy = spec.stop_policy
    spec.stop_policy = FixedDepth(depth) if policy is None else dataclasses.replace(
        policy, max_depth=min(depth, policy.max_depth))
