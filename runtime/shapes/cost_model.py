"""The cost-aware default: from this machine's measured step costs and a drafter's measured
acceptance, predict the speed of every draft shape (:func:`predict_shapes`; depths alone:
:func:`choose_depth`), decide on measured speeds (:func:`decide_shape`: plain decoding unless a
shape beats it by more than the noise), or derive SpecDec++'s h.

Model of one speculative step drafting to depth K (``nodes(K)`` tree nodes, root included):
    time(K)   = draft_fixed_ms + draft_ms_per_depth * K + verify_ms(nodes(K)) + overhead_ms
                + overhead_per_node_ms * nodes(K)
    tokens(K) = 1 + sum_{d<=K} acc[d] (acc[d]: cumulative acceptance at draft position d, the
    bench's curve)
and plain decoding emits one token per ``ar_step_ms``. Predicted speedup(K) = tokens(K) / time(K) *
ar_step_ms. K = 0 means plain decoding (speedup 1 by definition), so a drafter that cannot pay here
is never chosen. The verify curve is anchored to the loop's plain step (:func:`anchor_curve`) and
the per-step overhead is refitted on the timed shapes' measured steps (:func:`refit_overhead`), so
the prediction describes the loop it is checked on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from draftsmith.runtime.shapes.draft_shapes import PLAIN, RecordedStep, Shape, accepted_length


@dataclass(frozen=True)
class MachineCosts:
    """Measured costs on this machine for one (target, dtype, backend, drafter)."""

    ar_step_ms: float  # one plain decode step
    verify_ms: dict[
        int, float
    ]  # forward of n new tokens -> ms (interpolated between the measured sizes)
    draft_ms_per_depth: float = 0.0  # drafting one more depth level in a step
    overhead_ms: float = 0.0  # per speculative step, besides drafting and the verify forward
    # drafting cost per step whatever the depth (Medusa-family heads run once)
    draft_fixed_ms: float = 0.0
    # per verified node, besides the verify forward (fit on timed steps)
    overhead_per_node_ms: float = 0.0

    def rest_ms(self, depth: int, nodes: float) -> float:
        """Per-step ms besides the verify forward: drafting ``depth`` levels and the overhead of
        ``nodes`` nodes."""
        return (
            self.draft_fixed_ms
            + self.draft_ms_per_depth * depth
            + self.overhead_ms
            + self.overhead_per_node_ms * nodes
        )

    def verify_at(self, nodes: int) -> float:
        """Verify-forward ms for ``nodes`` new tokens, linear between measured sizes (extrapolated
        past them)."""
        sizes = sorted(int(n) for n in self.verify_ms)
        ms = {int(n): float(v) for n, v in self.verify_ms.items()}
        if nodes in ms:
            return ms[nodes]
        lo = max([n for n in sizes if n < nodes], default=sizes[0])
        hi = min([n for n in sizes if n > nodes], default=sizes[-1])
        if lo == hi:  # beyond the measured range: extend the last segment's slope
            lo, hi = (sizes[-2], sizes[-1]) if nodes > sizes[-1] and len(sizes) > 1 else (lo, hi)
            if lo == hi:
                return ms[lo]
        return ms[lo] + (ms[hi] - ms[lo]) * (nodes - lo) / (hi - lo)


@dataclass
class DepthChoice:
    """The chosen draft depth (0 = plain decoding) and the prediction for every candidate."""

    depth: int
    predicted_speedup: float
    table: list[dict[str, float]] = field(
        default_factory=list
    )  # per depth: tokens, step ms, speedup

    @property
    def speculation_loses(self) -> bool:
        """True when no draft depth is predicted to beat plain decoding."""
        return self.depth == 0

    def summary(self) -> str:
        """One line for the bench and the log."""
        best_spec = max(
            (r for r in self.table if r["depth"] > 0), key=lambda r: r["speedup"], default=None
        )
        if self.depth == 0:
            loss = (
                ""
                if best_spec is None
                else (
                    f" (best draft depth {int(best_spec['depth'])} predicted at "
                    f"{best_spec['speedup']:.2f}x, "
                    f"i.e. {100 * (1 - best_spec['speedup']):.0f}% slower)"
                )
            )
            return f"speculation is predicted to lose on this machine{loss}: serving plain decoding"
        return f"draft depth {self.depth} predicted at {self.predicted_speedup:.2f}x plain decoding"


def choose_depth(
    cum_acceptance: Sequence[float],
    costs: MachineCosts,
    nodes_for_depth: Callable[[int], int] = lambda d: d + 1,
    min_gain: float = 0.03,
) -> DepthChoice:
    """Pick the depth K in 0..len(cum_acceptance) with the highest predicted speed (see the module
    docstring). ``nodes_for_depth(K)``: tree nodes verified when drafting to depth K (a chain: K +
    1). Speculation is chosen only when predicted to beat plain decoding by ``min_gain`` (the
    prediction's own error is a few percent).
    """
    table = [{"depth": 0, "tokens": 1.0, "step_ms": costs.ar_step_ms, "speedup": 1.0}]
    tokens = 1.0
    for k, acc in enumerate(cum_acceptance, start=1):
        tokens += float(acc)
        step = costs.verify_at(nodes_for_depth(k)) + costs.rest_ms(k, nodes_for_depth(k))
        table.append(
            {
                "depth": k,
                "tokens": tokens,
                "step_ms": step,
                "speedup": tokens / step * costs.ar_step_ms,
            }
        )
    best = max(table, key=lambda r: (r["speedup"], -r["depth"]))
    if best["speedup"] < 1.0 + min_gain:
        best = table[0]
    return DepthChoice(int(best["depth"]), best["speedup"], table)


@dataclass
class ShapeChoice:
    """The served shape (:data:`~draftsmith.runtime.shapes.draft_shapes.PLAIN`: plain decoding),
    why, and for every candidate its prediction (and, for those timed, the measured speedup)."""

    shape: Shape
    why: str
    predicted_speedup: float = 1.0
    measured_speedup: float | None = None
    noise: float | None = None
    table: list[dict[str, Any]] = field(default_factory=list)

    @property
    def depth(self) -> int:
        """Drafted levels of the served shape (0: plain decoding)."""
        return 0 if self.shape.kind == "plain" else self.shape.depth

    @property
    def speculation_loses(self) -> bool:
        """True when plain decoding is served."""
        return self.shape.kind == "plain"

    def summary(self) -> str:
        """One line for the bench and the log."""
        return self.why


def predict_shapes(
    steps: Sequence[RecordedStep],
    shapes: Sequence[Shape],
    costs: MachineCosts,
    static_paths: Callable[[Shape], set[tuple[int, ...]] | None] = lambda s: None,
) -> list[dict[str, Any]]:
    """Predicted tokens per step, step ms and speedup over plain decoding of every shape, from the
    recorded calibration steps (:func:`~draftsmith.runtime.shapes.draft_shapes.accepted_length`) and
    this machine's costs: ``step = mean verify_at(nodes) + costs.rest_ms(depth, mean nodes)``. Best
    first, plain included.
    """
    if not steps:
        raise ValueError("no calibration steps to predict shapes from")
    rows = [
        {
            "shape": PLAIN.label,
            "spec": asdict(PLAIN),
            "tokens": 1.0,
            "nodes": 1.0,
            "step_ms": costs.ar_step_ms,
            "predicted_speedup": 1.0,
        }
    ]
    for shape in shapes:
        paths = static_paths(shape)
        got = [accepted_length(step, shape, paths) for step in steps]
        tokens = 1.0 + sum(a for a, _ in got) / len(got)
        verify = sum(costs.verify_at(n) for _, n in got) / len(got)
        nodes = sum(n for _, n in got) / len(got)
        step_ms = verify + costs.rest_ms(shape.depth, nodes)
        rows.append(
            {
                "shape": shape.label,
                "spec": asdict(shape),
                "tokens": tokens,
                "nodes": nodes,
                "verify_ms": verify,
                "step_ms": step_ms,
                "predicted_speedup": tokens / step_ms * costs.ar_step_ms,
            }
        )
    return sorted(rows, key=lambda r: (-r["predicted_speedup"], r["nodes"]))


def decide_shape(
    table: list[dict[str, Any]], measured: dict[str, float], noise: float
) -> ShapeChoice:
    """Serve the best *measured* shape if it beats plain decoding by more than ``noise`` (a
    fraction); else plain decoding, saying why. ``measured``: shape label -> measured speedup over
    plain decoding (timed interleaved).
    """
    for row in table:
        row["measured_speedup"] = measured.get(
            row["shape"], 1.0 if row["shape"] == PLAIN.label else None
        )
    timed = [r for r in table if r["shape"] != PLAIN.label and r["measured_speedup"] is not None]
    if not timed:
        best = max(
            (r for r in table if r["shape"] != PLAIN.label),
            key=lambda r: r["predicted_speedup"],
            default=None,
        )
        why = (
            "no draft shape is predicted to beat plain decoding"
            + (
                f" (best {best['shape']} predicted at {best['predicted_speedup']:.2f}x)"
                if best
                else ""
            )
            + ": serving plain decoding"
        )
        return ShapeChoice(PLAIN, why, 1.0, None, noise, table)
    best = max(timed, key=lambda r: r["measured_speedup"])
    said = (
        f"{best['shape']} measured at {best['measured_speedup']:.2f}x runtime AR (predicted "
        f"{best['predicted_speedup']:.2f}x; noise {noise:.0%})"
    )
    if best["measured_speedup"] > 1.0 + noise:
        return ShapeChoice(
            Shape.from_dict(best["spec"]),
            f"{said}: serving it",
            best["predicted_speedup"],
            best["measured_speedup"],
            noise,
            table,
        )
    return ShapeChoice(
        PLAIN,
        f"best measured shape {said} does not beat runtime AR by more than the noise: "
        "serving plain decoding",
        1.0,
        best["measured_speedup"],
        noise,
        table,
    )


def anchor_curve(curve: dict[int, float], ar_step_ms: float) -> tuple[dict[int, float], float]:
    """The verify curve scaled so that its 1-token forward equals the loop's plain step: ``(curve,
    scale)``. A curve timed at another moment (the bench reuses its own) sat 15% above the loop's
    step on one run; its shape is kept, its level is the loop's (a 1-token forward *is* a plain
    step)."""
    if 1 not in curve or curve[1] <= 0 or ar_step_ms <= 0:
        return dict(curve), 1.0
    scale = ar_step_ms / curve[1]
    return {int(n): float(v) * scale for n, v in curve.items()}, scale


def refit_overhead(
    costs: MachineCosts,
    calibration_nodes: float,
    timed: Sequence[dict[str, Any]],
) -> tuple[MachineCosts, list[dict[str, float]]]:
    """Refit the per-step overhead as ``a + b * nodes`` (least squares, ``a, b >= 0``) on what the
    loop measured: the profiled calibration step (``costs.overhead_ms`` at ``calibration_nodes``,
    the superset tree) and every timed shape's measured decode step minus its drafting and verify
    forward. ``timed`` rows: ``nodes``, ``verify_ms``, ``depth``, ``measured_step_ms``. The
    calibration charged its 16-node step's overhead to every candidate, which under-predicted small
    shapes by 11-15% on the Zen 4 (docs/notebook/MEASUREMENTS.md section 14). Returns the refitted
    costs and the points. Fewer than two distinct node counts: the overhead becomes their mean, per
    node 0.
    """
    points = [
        {
            "nodes": float(calibration_nodes),
            "overhead_ms": float(costs.overhead_ms),
            "source": "calibration",
        }
    ]
    bare = replace(costs, overhead_ms=0.0, overhead_per_node_ms=0.0)
    for row in timed:
        rest = (
            row["measured_step_ms"]
            - row["verify_ms"]
            - bare.rest_ms(int(row["depth"]), row["nodes"])
        )
        points.append(
            {"nodes": float(row["nodes"]), "overhead_ms": float(rest), "source": str(row["shape"])}
        )
    xs, ys = [p["nodes"] for p in points], [p["overhead_ms"] for p in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = (
        sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread > 1e-9 else 0.0
    )
    slope = max(0.0, slope)
    intercept = mean_y - slope * mean_x
    if intercept < 0.0:  # through the origin instead: the overhead cannot be negative
        slope = max(0.0, sum(x * y for x, y in zip(xs, ys)) / max(sum(x * x for x in xs), 1e-9))
        intercept = 0.0
    return replace(costs, overhead_ms=intercept, overhead_per_node_ms=slope), points


def threshold_from_costs(costs: MachineCosts, nodes: int = 2) -> float:
    """SpecDec++'s h for this machine: drafting one more token pays only if the chance that it is
    emitted (every token so far accepted, it too) exceeds its cost relative to a plain step, ``c =
    (draft_ms_per_depth + marginal verify ms) / ar_step_ms``; so stop once P(some rejection) > h = 1
    - c (clamped to [0.05, 0.95]).
    """
    marginal = (
        max(0.0, costs.verify_at(nodes + 1) - costs.verify_at(nodes)) + costs.overhead_per_node_ms
    )
    c = (costs.draft_ms_per_depth + marginal) / costs.ar_step_ms
    return min(0.95, max(0.05, 1.0 - c))
