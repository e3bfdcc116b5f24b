"""The learning curve's outputs: ``curve.json`` gains a ``fit`` block, ``curve.md`` a table (each
point raw and cooled), ``curve.png`` the picture (:mod:`draftsmith.evals.curve_plot`); the forecast
and its check are :mod:`draftsmith.evals.curve_forecast`'s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftsmith.evals.curve_forecast import fits as forecast_fits
from draftsmith.evals.curve_forecast import forecast_lines
from draftsmith.evals.curve_pick import cooled_points


def prompt_sets(data: dict[str, Any]) -> list[str]:
    """The prompt sets the curve evaluates on."""
    return list(data["settings"]["prompt_sets"])


def settle_cpu_hours(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each point's cumulative training CPU-hours from the segments' measured CPU time
    (``train_cpu_seconds_total`` differences); a segment without a CPU measurement (folders written
    before it existed) is estimated at the measured segments' CPU seconds per token and marked
    ``cpu_hours_estimated``. Points without any measured segment keep their wall-clock figure."""
    measured: dict[int, float] = {}  # steps -> that segment's CPU seconds
    before_total = None
    for p in points:
        total = p.get("train_cpu_seconds_total")
        if total:
            measured[p["steps"]] = total - (before_total or 0.0)
        before_total = total
    segments = [
        (p["tokens"] - (points[i - 1]["tokens"] if i else 0), measured.get(p["steps"]))
        for i, p in enumerate(points)
    ]
    known = [(t, c) for t, c in segments if c is not None and t and t > 0]
    if not known:
        return [{**p, "cooled": _settled(p, p.get("cpu_hours"))} for p in points]
    per_token = sum(c for _, c in known) / sum(t for t, _ in known)
    running, out = 0.0, []
    for p, (tokens, cpu) in zip(points, segments):
        running += cpu if cpu is not None else per_token * (tokens or 0)
        # a curve trained from a feature cache also pays the cache's build (its share so far,
        # run_point's bill)
        hours = (running + (p.get("cache_cpu_seconds") or 0.0)) / 3600.0
        out.append(
            {
                **p,
                "cpu_hours": hours,
                "cpu_hours_estimated": cpu is None,
                "cooled": _settled(p, hours),
            }
        )
    return out


def _settled(point: dict[str, Any], hours: float | None) -> dict[str, Any] | None:
    """The point's cooled block with its cumulative CPU-hours: the main run's at the branch point
    plus the branch."""
    cooled = point.get("cooled")
    if not cooled or hours is None:
        return cooled
    return {**cooled, "cpu_hours": hours + (cooled.get("branch_cpu_seconds") or 0.0) / 3600.0}


def tokens_per_cpu_hour(points: list[dict[str, Any]]) -> float | None:
    """Training tokens per CPU-hour over the whole run so far (the last point's totals)."""
    last = points[-1] if points else None
    if not last or not last.get("tokens") or not last.get("cpu_hours"):
        return None
    return last["tokens"] / last["cpu_hours"]


def with_cost_aware(data: dict[str, Any]) -> dict[str, Any]:
    """Every point's ``cost_aware`` shape (tau, predicted speedup) from the curve's costs, the same
    costs for every point (points evaluated before any costs, or recorded without a shape table, get
    none)."""
    from draftsmith.evals.curve_folder import costs_of
    from draftsmith.evals.learning_curve import cost_aware

    costs = costs_of(data)
    evaluations = [p["eval"] for p in data["points"]] + [
        (p.get("cooled") or {}).get("eval") for p in data["points"]
    ]
    for evaluation in filter(None, evaluations):
        for name in prompt_sets(data):
            record = evaluation[name]
            if costs is not None and record.get("shapes") and "node_counts" in record["shapes"][0]:
                record["cost_aware"] = cost_aware(record["shapes"], costs)
    return data


def fits(data: dict[str, Any]) -> dict[str, Any]:
    """Per prompt set: the first-position acceptance fit of the cooled points (raw where there are
    none), its forecast for that set's target and its intervals
    (:func:`draftsmith.evals.curve_forecast.fits`).
    """
    return forecast_fits(data, tokens_per_cpu_hour([p for p in data["points"] if p.get("tokens")]))


def fmt_value(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}" if abs(value) < 1e4 else f"{value:,.3g}"
    return str(value)


def _costs_note(data: dict[str, Any]) -> str:
    kept = data.get("costs_contention") or {}
    if data.get("costs") is None:
        return "none measured yet"
    if kept.get("contended"):
        return (
            f"timed while other processes used {kept.get('others_cpu_share', 0):.0%} of the CPUs:"
            " contended"
        )
    return "timed on a quiet machine"


def _cache_note(data: dict[str, Any]) -> str:
    bill = data.get("feature_cache")
    if not bill:
        return ""
    if bill.get("cpu_seconds") is None:
        return (
            f", trained from the feature cache {bill['path']} whose build cost was not recorded"
            " (not included)"
        )
    return (
        f", plus the feature cache's build ({bill['cpu_seconds'] / 3600:.2f} CPU-h for "
        f"{bill['train_tokens']:,} training tokens, billed pro rata over the first epoch)"
    )


def best_point(data: dict[str, Any]) -> dict[str, Any] | None:
    """The export (a point's, or its cooldown branch's) that reads the highest mean first-position
    acceptance over the held-out prompt sets (the one to serve: training loss keeps falling after
    acceptance peaks), with how far the last reading is below it; None before the first point."""
    names = prompt_sets(data)
    readings = [(p, f"points/step{p['steps']}/export", False) for p in data["points"]]
    readings += [
        (c, c.get("export") or f"points/step{c['branched_at']}/cooled/export", True)
        for c in cooled_points(data)
    ]
    readings.sort(key=lambda r: (r[0]["steps"], r[2]))
    scored = [
        (
            sum(p["eval"][n]["first_position_acceptance"] for n in names) / len(names),
            p,
            export,
            cooled,
        )
        for p, export, cooled in readings
        if names and all(n in p.get("eval", {}) for n in names)
    ]
    if not scored:
        return None
    mean, best, export, cooled = max(
        scored, key=lambda s: (s[0], -s[1]["steps"])
    )  # a tie keeps the cheaper one
    return {
        "steps": best["steps"],
        "tokens": best.get("tokens"),
        "mean_first_position": round(mean, 4),
        "export": export,
        "cooled": cooled,
        "last_below_by": round(mean - scored[-1][0], 4),
    }


def _best_line(data: dict[str, Any]) -> list[str]:
    best = data.get("best_point")
    if not best:
        return []
    fell = (
        f"; the last point reads {best['last_below_by']:.3f} lower: acceptance peaked before the"
        " run's end"
        if best["last_below_by"] > 0
        else ""
    )
    kind = "cooled " if best.get("cooled") else ""
    return [
        "",
        (
            f"Best {kind}point by held-out acceptance: step {best['steps']} (mean first-position "
            f"{best['mean_first_position']:.3f}), export `{best['export']}`{fell}."
        ),
    ]


def _row(steps: str, tokens: Any, hours: str, name: str, e: dict[str, Any], cooled: Any) -> str:
    aware = e.get("cost_aware") or {}
    return (
        f"| {steps} | {fmt_value(tokens)} | {hours} | {name} |"
        f" {fmt_value(e['first_position_acceptance'])} | {fmt_value(cooled)} |"
        f" {' / '.join(f'{a:.2f}' for a in e['conditional_acceptance'])} |"
        f" {fmt_value(e.get('draft_vocab_coverage'))} | {aware.get('shape', '-')} |"
        f" {fmt_value(aware.get('tau'), 2)} | {fmt_value(aware.get('predicted_speedup'), 2)}x |"
    )


def table_lines(data: dict[str, Any]) -> list[str]:
    """One row per point and prompt set (raw, with its cooled first-position beside it), then one
    per cooldown branch (``S+L (cooled)``: its tokens, CPU-hours and whole evaluation)."""
    lines = [
        (
            "| steps | tokens | CPU-h | prompts | first-position (raw) | cooled | per position"
            " d1-d4 | in draft vocab | cost-aware shape | tau | predicted speedup |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in data["points"]:
        hours = fmt_value(p["cpu_hours"], 2) + ("~" if p.get("cpu_hours_estimated") else "")
        cooled = (p.get("cooled") or {}).get("eval") or {}
        for name in prompt_sets(data):
            lines.append(
                _row(
                    str(p["steps"]),
                    p["tokens"],
                    hours,
                    name,
                    p["eval"][name],
                    (cooled.get(name) or {}).get("first_position_acceptance"),
                )
            )
        for name in prompt_sets(data) if cooled else ():
            c = p["cooled"]
            lines.append(
                _row(
                    f"{c['steps']} (cooled)",
                    c.get("tokens"),
                    fmt_value(c.get("cpu_hours"), 2),
                    name,
                    cooled[name],
                    cooled[name]["first_position_acceptance"],
                )
            )
    return lines


def markdown(data: dict[str, Any], fit_block: dict[str, Any]) -> str:
    """The curve as a markdown table (each point raw and cooled, per prompt set) plus the fit's
    forecast with its intervals and any forecast check."""
    fraction = float(data.get("cooldown") or 0.0)
    branches = (
        f"Cooled: a branch from the point whose LR decays linearly to 0 over {fraction:.0%} of its"
        " steps (it predicts a finished run of the branch's length); the fit reads the cooled"
        " values. "
        if fraction
        else "No cooldown branches (--cooldown 0): the fit reads the raw, mid-run values. "
    )
    lines = [
        f"# Learning curve: {' '.join(data['overrides'])}",
        "",
        (
            f"Machine: {data['machine']['cpu']}, {data['machine']['cores']} cores. Held-out"
            f" prompts: {data['settings']['prompts']} x {data['settings']['max_new_tokens']} new"
            " tokens, greedy, the runtime's own loop. CPU-h: the training processes' own CPU time"
            f" (~: estimated at the measured segments' rate){_cache_note(data)}."
            f" {branches}Acceptance at depths 1-4 is per position given the earlier ones were"
            f" accepted; speedups are predicted from one set of step costs ({_costs_note(data)})."
        ),
        "",
        *table_lines(data),
    ]
    lines += [*_best_line(data), "", *forecast_lines(fit_block, data.get("checks") or [])]
    return "\n".join(lines) + "\n"


def write_report(curve_dir: str | Path, data: dict[str, Any]) -> dict[str, Any]:
    """Write curve.md and curve.png beside curve.json; returns the fit block (also stored in
    curve.json)."""
    from draftsmith.evals.curve_folder import CURVE_FILE, write_json
    from draftsmith.evals.curve_plot import plot

    curve_dir = Path(curve_dir)
    data = {**data, "points": settle_cpu_hours(data["points"])}
    block = fits(data)
    data = {**with_cost_aware(data), "fit": block}
    data["best_point"] = best_point(data)
    write_json(curve_dir / CURVE_FILE, data)
    (curve_dir / "curve.md").write_text(markdown(data, block))
    if data["points"]:
        plot(data, block, curve_dir / "curve.png")
    return block
