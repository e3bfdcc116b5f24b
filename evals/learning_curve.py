"""Held-out acceptance of one export, the way the learning curve (``draftsmith curve``) records each
of its points.

For every prompt set (MT-Bench and HumanEval by default: prompts no training data contains, 8 x 128
new tokens, greedy), the export is served by the runtime's own speculative loop drafting the
calibration superset of its family (EAGLE: a 16-node, top-4, 4-deep dynamic tree), and every
verified tree is recorded with the path greedy verification accepted
(:class:`~draftsmith.runtime.shapes.draft_shapes.RecordedStep`). From those steps, without decoding
again:

- ``chain_acceptance``: cumulative acceptance of the drafter's top-1 chain, entry d-1 = P(first d
  drafted tokens all accepted); entry 0 is the *first-position acceptance* (how often the drafter's
  first guess is the target's token);
- ``conditional_acceptance``: entry d-1 = P(position d accepted | positions 1..d-1 accepted), the
  per-position acceptance the issue's 0.7 target is about (entry 0 equals the first-position
  acceptance);
- ``shapes``: tokens per step and verified nodes of every candidate shape; with the machine's step
  costs (:func:`measure_costs`, kept once per curve and preferably quiet) :func:`cost_aware` gives
  the shape the runtime's cost model would serve (plain decoding when nothing beats it), its tau and
  predicted speedup.

Speedups are predictions from one set of costs for every point (so the points differ by acceptance
alone); the bench times them (``draftsmith bench``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.bench.prompts import load_prompts
from draftsmith.runtime.decoding.profile import StepProfiler
from draftsmith.runtime.decoding.prompt_limits import context_limit
from draftsmith.runtime.serving import load_runtime
from draftsmith.runtime.shapes import draft_shapes
from draftsmith.runtime.shapes.cost_model import MachineCosts, anchor_curve
from draftsmith.runtime.shapes.loop_profile import StepRecorder
from draftsmith.runtime.shapes.target_timing import decode_step_ms, forward_curve, loop_head

# per-position acceptance is reported at depths 1..4 (the calibration superset's depth)
CHAIN_DEPTH = 4
COST_PROMPTS = 2  # prompts the step costs are measured on (once per curve)
COST_TOKENS = 32


@dataclass(frozen=True)
class EvalSettings:
    """What each curve point is evaluated on (recorded in curve.json so a resumed curve evaluates
    alike)."""

    prompt_sets: tuple[str, ...] = ("mtbench", "humaneval")
    prompts: int = 8
    max_new_tokens: int = 128
    dtype: str = "auto"
    target: str | None = None


def record_steps(
    spec: Any,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
) -> tuple[StepRecorder, dict[str, Any], list[Any]]:
    """Greedy speculative decoding of ``prompts`` drafting the family's calibration superset, every
    step recorded: (recorder, step profile, results)."""
    base = spec.proposer
    recorder = StepRecorder(draft_shapes.calibration_proposer(base), time.perf_counter)
    saved = spec.proposer, spec.stop_policy
    spec.proposer, spec.stop_policy = recorder, None  # the superset's own depth, no stop rule
    profiler = StepProfiler(spec.model.device, time.perf_counter)
    spec.profiler = profiler
    try:
        results = [
            spec.generate(
                p, max_new_tokens, eos_ids=eos_ids, generator=torch.Generator().manual_seed(i)
            )
            for i, p in enumerate(prompts)
        ]
    finally:
        spec.proposer, spec.stop_policy = saved
        spec.profiler = None
    return recorder, profiler.report(), results


def chain_acceptance(
    steps: Sequence[draft_shapes.RecordedStep], depth: int = CHAIN_DEPTH
) -> list[float]:
    """Cumulative acceptance of the top-1 chain: entry d-1 = share of steps whose first d chain
    tokens were accepted."""
    accepted = [
        draft_shapes.accepted_length(step, draft_shapes.Shape.chain(depth))[0] for step in steps
    ]
    return [
        sum(a >= d for a in accepted) / len(accepted) if accepted else 0.0
        for d in range(1, depth + 1)
    ]


def conditional(cumulative: Sequence[float]) -> list[float]:
    """Per-position acceptance given the previous positions were accepted (cumulative[d] /
    cumulative[d-1])."""
    out, before = [], 1.0
    for c in cumulative:
        out.append(c / before if before > 0 else 0.0)
        before = c
    return out


def measure_costs(runtime: Any, prompts: Sequence[list[int]]) -> MachineCosts:
    """This machine's step costs for the export's proposer: the verify curve (1..16 nodes) anchored
    to the plain step, drafting per depth level and the loop's per-step rest, from a short recorded
    run on ``prompts``.
    """
    spec = runtime.speculative
    calib = [list(p) for p in prompts[:COST_PROMPTS]]
    recorder, report, _ = record_steps(spec, calib, COST_TOKENS, runtime.eos_ids)
    head = loop_head(spec)
    ar_ms, _ = decode_step_ms(spec.model, calib, COST_TOKENS, head=head)
    curve, _ = anchor_curve(
        {int(n): float(v) for n, v in forward_curve(spec.model, calib[0], head=head).items()}, ar_ms
    )
    steps = max(1, len(recorder.steps))
    rest = (
        report["verification_ms"]
        + report["kv_compaction_ms"]
        + report["proposer_update_ms"]
        + max(0.0, report["unattributed_ms"])
    )
    draft_ms = 1e3 * recorder.draft_s / steps
    # heads: one draft call, whatever the shape
    if draft_shapes.family_of(spec.proposer) == "static_tree":
        return MachineCosts(ar_ms, curve, 0.0, rest, draft_ms)
    mean_depth = sum(max(s.depths) for s in recorder.steps) / steps
    return MachineCosts(ar_ms, curve, draft_ms / max(mean_depth, 1.0), rest)


def shape_table(steps: Sequence[draft_shapes.RecordedStep], base: Any) -> list[dict[str, Any]]:
    """Every candidate shape's tokens per step and verified nodes on the recorded ``steps`` (no
    costs needed): the nodes as a histogram, so a prediction from any machine's costs is exact
    (:func:`cost_aware`)."""
    rows = []
    for shape in draft_shapes.candidates(base):
        got = [
            draft_shapes.accepted_length(step, shape, draft_shapes.static_paths_of(base, shape))
            for step in steps
        ]
        nodes: dict[str, int] = {}
        for _, n in got:
            nodes[str(n)] = nodes.get(str(n), 0) + 1
        rows.append(
            {
                "shape": shape.label,
                "depth": shape.depth,
                "tokens": 1.0 + sum(a for a, _ in got) / len(got),
                "nodes": sum(n for _, n in got) / len(got),
                "node_counts": nodes,
            }
        )
    return rows


def cost_aware(table: Sequence[dict[str, Any]], costs: MachineCosts) -> dict[str, Any]:
    """The shape the runtime's cost model would serve (predicted speedup over plain decoding, plain
    included): step = mean verify of the nodes verified + drafting and overhead, as
    :func:`cost_model.predict_shapes` predicts it.
    """
    best = {"shape": draft_shapes.PLAIN.label, "tau": 1.0, "predicted_speedup": 1.0}
    for row in table:
        count = sum(row["node_counts"].values())
        verify = sum(costs.verify_at(int(n)) * c for n, c in row["node_counts"].items()) / count
        speedup = (
            row["tokens"]
            / (verify + costs.rest_ms(int(row["depth"]), row["nodes"]))
            * costs.ar_step_ms
        )
        if speedup > best["predicted_speedup"]:
            best = {"shape": row["shape"], "tau": row["tokens"], "predicted_speedup": speedup}
    return best


def summarize(steps: Sequence[draft_shapes.RecordedStep], base: Any) -> dict[str, Any]:
    """The point's record for one prompt set (see the module docstring); ``cost_aware`` is added
    from the curve's costs when it is reported."""
    cumulative = chain_acceptance(steps)
    return {
        "verify_steps": len(steps),
        "first_position_acceptance": cumulative[0],
        "chain_acceptance": cumulative,
        "conditional_acceptance": conditional(cumulative),
        "chain_tau": {f"chain:{d}": 1.0 + sum(cumulative[:d]) for d in range(1, CHAIN_DEPTH + 1)},
        "shapes": shape_table(steps, base),
    }


def draft_vocabulary(export_dir: str) -> set[int] | None:
    """Target ids the export can draft (EAGLE-3's ``d2t``: target id = i + d2t[i]; heads'
    ``draft_ids``), or None for a drafter over the whole target vocabulary."""
    from safetensors import safe_open

    path = Path(export_dir) / "model.safetensors"
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
            if key.endswith("d2t"):
                d2t = f.get_tensor(key).long()  # [V'] offsets
                return set((torch.arange(d2t.numel()) + d2t).tolist())
            if key.endswith("draft_ids"):
                return set(f.get_tensor(key).long().tolist())
    return None


def coverage(results: Sequence[Any], vocabulary: set[int] | None) -> float | None:
    """Share of the target's greedy tokens the drafter could have drafted at all (a token outside
    the draft vocabulary is a certain miss)."""
    if vocabulary is None:
        return None
    tokens = [int(t) for r in results for t in r.tokens]
    return sum(t in vocabulary for t in tokens) / len(tokens) if tokens else None


def evaluate_export(
    export_dir: str,
    settings: EvalSettings,
    measure: bool = False,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Evaluate ``export_dir`` on every prompt set of ``settings``: ({prompt set: record}, measured
    costs). With ``measure``, this machine's step costs are measured first (on the first prompt set)
    and returned with the contention verdict of the interval
    (:func:`draftsmith.bench.contention.verdict`): costs timed while other processes ran are marked,
    and the curve replaces them with quiet ones when it can."""
    from draftsmith.bench.contention import snapshot, verdict

    start = time.perf_counter()
    runtime = load_runtime(
        export_dir, settings.target, dtype=settings.dtype, verifier="greedy", temperature=0.0
    )
    spec = runtime.speculative
    out: dict[str, Any] = {"settings": asdict(settings)}
    vocabulary = draft_vocabulary(export_dir)
    measured = None
    for name in settings.prompt_sets:
        prompts = load_prompts(
            name, runtime.tokenizer, int(settings.prompts), max_len=context_limit(runtime.model)
        )
        if measure and measured is None:
            before = snapshot()
            costs = measure_costs(runtime, prompts)
            measured = {"costs": asdict(costs), "contention": verdict(before, snapshot())}
        recorder, _, results = record_steps(
            spec, prompts, int(settings.max_new_tokens), runtime.eos_ids
        )
        out[name] = {
            **summarize(recorder.steps, spec.proposer),
            "generated_tokens": sum(len(r.tokens) for r in results),
            "draft_vocab_coverage": coverage(results, vocabulary),
        }
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out, measured
