"""``draftsmith bench export --profile``: the mean time of each part of a speculative step, each
against its bandwidth floor (:mod:`draftsmith.bench.floors`)."""

from __future__ import annotations

import statistics
from typing import Any

from draftsmith.bench import floors
from draftsmith.runtime.decoding.threads import governor
from draftsmith.runtime.drafting.base import Proposer
from draftsmith.runtime.serving import Runtime
from draftsmith.runtime.shapes import loop_profile, target_timing


def profile_steps(
    runtime: Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    export_proposer: Proposer = None,
    cost_model: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``bench --profile``: the mean ms of each part of a speculative step, and each against its
    bandwidth floor (:mod:`draftsmith.bench.floors`): the AR step (decode only, without the
    prefill), the verify forward of the mean tree, drafting per call and per drafted token, with one
    verdict line per target. Where the served policy drafts nothing (the cost-aware choice served
    plain decoding), the best measured draft shape (else the export's own proposer) is profiled
    instead, so drafting is still measured against its floor.
    """
    spec = runtime.speculative
    saved, profiled = (spec.proposer, spec.stop_policy), "the served policy"
    try:
        if spec.serves_plain_ar() and export_proposer is not None:
            profiled = floors.apply_profiled_shape(spec, export_proposer, cost_model)
        drafting = spec.proposer
        with floors.counting_draft_calls(spec.proposer, runtime.model) as counted:
            report, results, _ = loop_profile.profiled_run(
                spec, prompts, max_new_tokens, runtime.eos_ids
            )
    finally:
        spec.proposer, spec.stop_policy = saved
    report["profiled"] = profiled
    steps = max(1, report["steps"])
    sizes = [n for r in results for n in r.tree_sizes]
    steps_info = {
        "context_tokens": statistics.mean(
            len(p) + len(r.tokens) / 2 for p, r in zip(prompts, results)
        ),
        "tree_nodes": statistics.mean(sizes) if sizes else 1.0,
        "draft_calls": counted["calls"] / steps if counted["calls"] else 1.0,
        "draft_calls_source": (
            "counted" if counted["calls"] else "assumed one per step (none counted)"
        ),
    }
    # the plain loop without its prefill, on the same prompts (the cost model's calibration prompts
    # may differ)
    ar_tokens = min(max_new_tokens, 32)
    ar_ms = target_timing.decode_step_ms(
        runtime.model, prompts, ar_tokens, head=target_timing.loop_head(runtime.speculative)
    )[0]
    steps_info["ar_context_tokens"] = statistics.mean(len(p) for p in prompts) + ar_tokens / 2
    # the threads the runtime decodes with on a quiet machine (the governor lends fewer while others
    # hold cores)
    threads = governor().max_threads
    found = floors.step_floors(
        runtime.model,
        drafting,
        report,
        steps_info,
        ar_ms,
        floors.read_bandwidth_gbs(threads),
        threads,
    )
    return {**report, "floors": found, "verdicts": floors.verdicts(found)}
