"""Pick among learning curves at an equal budget: each curve's held-out first-position acceptance
(its cooled readings, :func:`reading_points`) at the same CPU-hours (and, for a peer trainer
compared by data, the same training tokens), interpolated on a log axis between its measured points,
never extrapolated; the curve with the highest mean over its prompt sets is *picked*, and ``make
train-best`` trains with the picked curve's overrides.

Run as ``python -m draftsmith.evals.curve_pick COMPARE_JSON [--without KEY,...]``: prints the picked
overrides, one shell word each (what ``make train-best`` reads), without the keys named. Imports
nothing heavy (the Makefile runs it at parse time).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
from collections.abc import Sequence
from typing import Any

# The curve's own defaults (evals/curve_training.py DEFAULT_OVERRIDES): they shape a curve's
# evaluation, not the recipe.
CURVE_DEFAULTS = (
    "optim.scheduler=constant",
    "validation.served_tau.every=0",
    "run.final_eval_batches=1",
)


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """``ys`` at ``x``, linear in log(x) between the two measured points around it; None outside the
    measured range (a budget a curve did not reach says nothing about it)."""
    pairs = sorted((float(a), float(b)) for a, b in zip(xs, ys) if a and a > 0)
    if not pairs or not pairs[0][0] <= x <= pairs[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(pairs, pairs[1:]):
        if x0 <= x <= x1:
            w = 0.0 if x1 == x0 else (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return pairs[0][1]  # one point, exactly at x


def cooled_points(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The curve's cooled readings as points of their own: each branch's steps, tokens, CPU-hours
    (the main run's at the branch point plus the branch's) and evaluation; a point without a branch
    has none."""
    out = []
    for p in data["points"]:
        cooled = p.get("cooled")
        if not cooled or not cooled.get("eval"):
            continue
        hours = cooled.get("cpu_hours")
        if hours is None and p.get("cpu_hours") is not None:
            hours = p["cpu_hours"] + (cooled.get("branch_cpu_seconds") or 0.0) / 3600.0
        out.append(
            {
                "steps": cooled["steps"],
                "tokens": cooled.get("tokens"),
                "cpu_hours": hours,
                "eval": cooled["eval"],
                "branched_at": p["steps"],
                "export": cooled.get("export"),
            }
        )
    return out


def reading_points(data: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The points a fit or a comparison reads, and which: the cooled ones when the curve has any
    (they predict a finished run), else the raw ones (curves from before cooldown branches, or
    ``--cooldown 0``)."""
    cooled = cooled_points(data)
    return (cooled, "cooled") if cooled else (list(data["points"]), "raw")


def recipe_overrides(overrides: Sequence[str]) -> list[str]:
    """A curve's overrides without the curve's own evaluation defaults: the recipe as a training run
    takes it."""
    return [o for o in overrides if o not in CURVE_DEFAULTS]


def at_budget(curves: dict[str, dict[str, Any]], key: str) -> dict[str, Any]:
    """Every curve's first-position acceptance per prompt set at the largest ``key`` (``cpu_hours``
    or ``tokens``) all curves reached, and their mean."""
    read = {name: reading_points(data) for name, data in curves.items()}
    reach = [
        max((p.get(key) or 0.0) for p in points) if points else 0.0 for points, _ in read.values()
    ]
    budget = min(reach) if reach else 0.0
    rows = {}
    for name, data in curves.items():
        points = [p for p in read[name][0] if p.get(key)]
        sets = list(data["settings"]["prompt_sets"])
        got = {
            s: interpolate(
                [p[key] for p in points],
                [p["eval"][s]["first_position_acceptance"] for p in points],
                budget,
            )
            for s in sets
        }
        known = [v for v in got.values() if v is not None]
        mean = sum(known) / len(known) if known else None
        rows[name] = {
            "first_position": got,
            "mean": mean,
            "stderr": _stderr(points, sets, key, budget, mean),
            "values": read[name][1],
        }
    return {"key": key, "budget": budget, "curves": rows}


def _stderr(
    points: list[dict[str, Any]], sets: list[str], key: str, budget: float, mean: float | None
) -> float | None:
    """Binomial standard error of the mean first-position acceptance at ``budget``: each set's
    verified steps at the measured point nearest the budget (log distance) are its trials; None when
    a record lacks the count.
    """
    if mean is None or not points:
        return None
    near = min(
        points, key=lambda p: abs(math.log(p[key]) - math.log(budget)) if budget > 0 else 0.0
    )
    trials = [near["eval"][s].get("verify_steps") for s in sets]
    if not all(trials):
        return None
    p = min(max(mean, 1e-6), 1 - 1e-6)
    return math.sqrt(p * (1 - p) / sum(trials))


def pick(curves: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The comparison at equal CPU-hours and at equal tokens, and the curve picked at equal
    CPU-hours (the budget a user pays): ``{"equal_cpu_hours", "equal_tokens", "picked": {"curve",
    "mean", "overrides"}}``.
    """
    by_cpu, by_tokens = at_budget(curves, "cpu_hours"), at_budget(curves, "tokens")
    scored = [
        (row["mean"], name) for name, row in by_cpu["curves"].items() if row["mean"] is not None
    ]
    picked = None
    if scored:
        scored.sort(reverse=True)
        mean, name = scored[0]
        picked = {
            "curve": name,
            "mean": mean,
            "overrides": recipe_overrides(curves[name]["overrides"]),
            "decisive": None,
            "margin": None,
            "noise": None,
        }
        if len(scored) > 1:  # is the lead larger than two standard errors of the difference?
            errors = [by_cpu["curves"][n]["stderr"] for _, n in scored[:2]]
            margin = mean - scored[1][0]
            noise = (
                math.sqrt(sum(e * e for e in errors))
                if all(e is not None for e in errors)
                else None
            )
            picked.update(
                margin=margin, noise=noise, decisive=None if noise is None else margin > 2 * noise
            )
    return {"equal_cpu_hours": by_cpu, "equal_tokens": by_tokens, "picked": picked}


def main(argv: Sequence[str] | None = None) -> int:
    """Print the picked overrides of a compare.json (``draftsmith curve --compare``), minus
    ``--without`` keys."""
    p = argparse.ArgumentParser(
        prog="python -m draftsmith.evals.curve_pick", description=main.__doc__
    )
    p.add_argument("compare_json")
    p.add_argument(
        "--without", default="", help="comma-separated keys to leave out (the caller sets them)"
    )
    opts = p.parse_args(argv)
    picked = json.loads(open(opts.compare_json).read()).get("pick", {}).get("picked")
    if not picked:
        raise SystemExit(
            f"{opts.compare_json}: no curve was picked (no curve reached a common budget)"
        )
    drop = {k for k in opts.without.split(",") if k}
    print(
        " ".join(
            shlex.quote(o)
            for o in picked["overrides"]
            if o.lstrip("+~").split("=", 1)[0] not in drop
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
