"""What a learning curve forecasts, with its uncertainty, and the check of a forecast against a
finished run.

The fit (:mod:`draftsmith.evals.curve_fit`) reads the curve's cooled points when it has them
(:func:`~draftsmith.evals.curve_pick.reading_points`: each predicts a finished run of its branch's
length), else the raw ones. Its interval is a parametric bootstrap: every point's first-position
acceptance is redrawn around the fit with a standard deviation that joins the point's sampling noise
(binomial over its verified steps) and the fit's own error (its rmse), the curve is refitted, and
the interval holds the central ``LEVEL`` of the refits' values at a budget (or of the tokens they
need for a target). The draws are seeded, so a report reads the same every time.

``check``: a finished run (cosine to its end) at a larger budget than any point is the forecast's
test: its measured first-position acceptance on the same held-out prompts should lie inside the
interval the curve gives at its tokens.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from draftsmith.evals.curve_fit import CurveFit, fit_curve, forecast
from draftsmith.evals.curve_pick import reading_points

DRAWS = 200
LEVEL = 0.9  # the central share of the bootstrap's refits an interval holds
HORIZONS = (2, 4, 10)  # forecasts at these multiples of the furthest point's tokens
# The held-out targets for EAGLE-3 first-position acceptance, by prompt set.
TARGETS = {"mtbench": 0.75, "humaneval": 0.70}


def noise(point: dict[str, Any], name: str, rmse: float) -> float:
    """The standard deviation a point's first-position acceptance is redrawn with: its binomial
    sampling noise over its verified steps, joined with the fit's rmse (what the law itself
    misses)."""
    record = point["eval"][name]
    p, trials = float(record["first_position_acceptance"]), int(record.get("verify_steps") or 0)
    binomial = math.sqrt(max(p * (1 - p), 1e-6) / trials) if trials else 0.0
    return math.sqrt(binomial**2 + rmse**2)


def bootstrap(
    points: Sequence[dict[str, Any]],
    name: str,
    fit: CurveFit,
    bound: float,
    draws: int = DRAWS,
    seed: int = 0,
) -> list[CurveFit]:
    """Refits of the curve on points redrawn around ``fit`` (:func:`noise`); draws whose refit fails
    are dropped."""
    rng = random.Random(seed)
    xs = [float(p["tokens"]) for p in points]
    sigmas = [noise(p, name, fit.rmse) for p in points]
    refits = []
    for _ in range(draws):
        ys = [min(1.0, max(0.0, fit.at(x) + rng.gauss(0.0, s))) for x, s in zip(xs, sigmas)]
        refit = fit_curve(xs, ys, bound)
        if refit is not None:
            refits.append(refit)
    return refits


def central(values: Sequence[float], level: float = LEVEL) -> list[float] | None:
    """The central ``level`` of ``values`` (inf for a target a refit never reaches); None without
    values."""
    ordered = sorted(values)
    if not ordered:
        return None
    tail = (1.0 - level) / 2.0
    lo = ordered[int(math.floor(tail * (len(ordered) - 1)))]
    hi = ordered[int(math.ceil((1.0 - tail) * (len(ordered) - 1)))]
    return [lo, hi]


def usable(points: Sequence[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Points with tokens and an evaluation of ``name``."""
    return [p for p in points if p.get("tokens") and name in (p.get("eval") or {})]


def fit_of(points: Sequence[dict[str, Any]], name: str) -> tuple[CurveFit | None, float | None]:
    """(the fit of ``name``'s first-position acceptance over ``points``, the coverage bound it was
    fitted under)."""
    covered = [p["eval"][name].get("draft_vocab_coverage") for p in points]
    coverage = min(
        (c for c in covered if c is not None), default=None
    )  # the same target tokens at every point
    xs = [p["tokens"] for p in points]
    ys = [p["eval"][name]["first_position_acceptance"] for p in points]
    return fit_curve(xs, ys, coverage if coverage is not None else 1.0), coverage


def predict(points: Sequence[dict[str, Any]], name: str, tokens: float) -> dict[str, Any] | None:
    """The fit's value at ``tokens`` and its interval (None without a fit)."""
    points = usable(points, name)
    fit, coverage = fit_of(points, name)
    if fit is None:
        return None
    refits = bootstrap(points, name, fit, coverage if coverage is not None else 1.0)
    return {
        "tokens": tokens,
        "value": fit.at(tokens),
        "interval": central([r.at(tokens) for r in refits]),
        "level": LEVEL,
    }


def set_block(
    points: Sequence[dict[str, Any]], name: str, rate: float | None, values: str
) -> dict[str, Any]:
    """One prompt set's fit, its forecast for the set's target (tokens with an interval) and its
    value at :data:`HORIZONS` times the furthest point's tokens, each with an interval."""
    points = usable(points, name)
    fit, coverage = fit_of(points, name)
    target = {"first_position": TARGETS[name]} if name in TARGETS else {}
    block = {
        "metric": "first_position_acceptance",
        "values": values,
        "coverage": coverage,
        **forecast(fit, target, rate, coverage),
    }
    if fit is None:
        return block
    refits = bootstrap(points, name, fit, coverage if coverage is not None else 1.0)
    last = max(p["tokens"] for p in points)
    block["interval_level"] = LEVEL
    block["at"] = [
        {
            "tokens": last * k,
            "value": fit.at(last * k),
            "interval": central([r.at(last * k) for r in refits]),
        }
        for k in HORIZONS
    ]
    for item in block["targets"].values():
        need = central(
            [math.inf if n is None else n for n in (r.tokens_for(item["target"]) for r in refits)]
        )
        # JSON has no infinity: a bound no refit reaches is null ("never" in curve.md)
        item["tokens_interval"] = (
            None if need is None else [None if math.isinf(v) else v for v in need]
        )
    return block


def fits(data: dict[str, Any], rate: float | None) -> dict[str, Any]:
    """Per prompt set: the fit of the cooled points (raw when the curve has none) with its forecast
    and intervals, and the raw points' fit beside it (``raw_fit``) for comparison."""
    read, values = reading_points(data)
    out = {}
    for name in data["settings"]["prompt_sets"]:
        out[name] = set_block(read, name, rate, values)
        if values == "cooled":
            raw, _ = fit_of(usable(data["points"], name), name)
            out[name]["raw_fit"] = (
                None
                if raw is None
                else {
                    "ceiling": raw.ceiling,
                    "scale": raw.scale,
                    "exponent": raw.exponent,
                    "rmse": raw.rmse,
                }
            )
    return out


def check(data: dict[str, Any], run: str, tokens: int, measured: dict[str, Any]) -> dict[str, Any]:
    """The forecast at a finished run's ``tokens`` against what it measured (``measured``: its
    evaluation, prompt set -> record): per set the forecast, its interval and whether the
    measurement lies inside."""
    read, values = reading_points(data)
    sets: dict[str, Any] = {}
    for name in data["settings"]["prompt_sets"]:
        got = (measured.get(name) or {}).get("first_position_acceptance")
        guess = predict(read, name, tokens)
        interval = (guess or {}).get("interval")
        inside = None if got is None or interval is None else interval[0] <= got <= interval[1]
        sets[name] = {
            "measured": got,
            "forecast": (guess or {}).get("value"),
            "interval": interval,
            "inside": inside,
        }
    verdicts = [s["inside"] for s in sets.values() if s["inside"] is not None]
    return {
        "run": run,
        "tokens": tokens,
        "values": values,
        "level": LEVEL,
        "sets": sets,
        "all_inside": all(verdicts) if verdicts else None,
    }


def furthest_tokens(data: dict[str, Any]) -> int:
    """The most tokens any reading of the curve (raw or cooled) has."""
    read, _ = reading_points(data)
    return max([int(p.get("tokens") or 0) for p in [*data["points"], *read]] or [0])


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "never"
    if isinstance(value, (int, float)) and abs(value) >= 1e4:
        return f"{value:,.3g}"
    return f"{value:.{digits}f}" if isinstance(value, float) else f"{value:,}"


def _tokens(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "never"
    return f"{value:,.3g}" if value >= 1e4 else f"{round(value):,}"


def _span(interval: Sequence[float] | None, digits: int = 3, tokens: bool = False) -> str:
    if not interval:
        return "-"
    show = (
        (lambda v: "never" if v is None else _tokens(v)) if tokens else (lambda v: _num(v, digits))
    )
    return f"[{show(interval[0])}, {show(interval[1])}]"


def forecast_lines(fit_block: dict[str, Any], checks: Sequence[dict[str, Any]]) -> list[str]:
    """The fit, its forecast with intervals and any forecast checks, as markdown lines."""
    lines = ["## Fit: first-position acceptance = ceiling - scale * tokens^(-exponent)", ""]
    for name, block in fit_block.items():
        fit = block.get("fit")
        if fit is None:
            lines.append(f"- {name}: no fit ({block.get('why')})")
            continue
        bound = (
            f" (at most {block['coverage']:.3f}, the draft vocabulary's coverage)"
            if block.get("coverage")
            else ""
        )
        raw = block.get("raw_fit")
        beside = f"; the raw points' fit: ceiling {raw['ceiling']:.3f}" if raw else ""
        lines.append(
            f"- {name} ({block.get('values', 'raw')} points): ceiling {fit['ceiling']:.3f}{bound},"
            f" exponent {fit['exponent']:.2f}, rmse {fit['rmse']:.3f}{beside}; flattens (< 0.01 a"
            f" doubling) at {_tokens(block['flattens_at_tokens'])} tokens"
        )
        level = block.get("interval_level", LEVEL)
        for at in block.get("at", []):
            lines.append(
                f"  - at {_tokens(at['tokens'])} tokens: {at['value']:.3f}, {level:.0%} interval "
                f"{_span(at['interval'])}"
            )
        for target in block["targets"].values():
            reach = (
                f"{_tokens(target['tokens'])} tokens ({_num(target['cpu_hours'], 1)} CPU-h),"
                f" {level:.0%} interval {_span(target.get('tokens_interval'), tokens=True)} tokens"
                if target["reachable"]
                else target["why"]
            )
            lines.append(f"  - {target['target']}: {reach}")
    if checks:
        lines += [
            "",
            "## Forecast check: finished runs at a larger budget",
            "",
            "| run | tokens | prompts | measured | forecast | interval | inside |",
            "|---|---|---|---|---|---|---|",
        ]
        for chk in checks:
            for name, got in chk["sets"].items():
                inside = {True: "yes", False: "**no**", None: "-"}[got["inside"]]
                lines.append(
                    f"| {chk['run']} | {_tokens(chk['tokens'])} | {name} | {_num(got['measured'])}"
                    f" | {_num(got['forecast'])} | {_span(got['interval'])} | {inside} |"
                )
    return lines
