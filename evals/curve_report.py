"""The learning curve's outputs: ``curve.json`` gains a ``fit`` block, ``curve.md`` a table, ``curve.png`` the
picture (acceptance against training tokens on a log axis, CPU-hours on the top axis, the fit dashed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftsmith.evals.curve_fit import fit_curve, forecast
from draftsmith.evals.curve_pick import pick

# The held-out targets for EAGLE-3 first-position acceptance, by prompt set.
TARGETS = {"mtbench": 0.75, "humaneval": 0.70}


def prompt_sets(data: dict[str, Any]) -> list[str]:
    """The prompt sets the curve evaluates on."""
    return list(data["settings"]["prompt_sets"])


def settle_cpu_hours(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each point's cumulative training CPU-hours from the segments' measured CPU time (``train_cpu_seconds_total``
    differences); a segment without a CPU measurement (folders written before it existed) is estimated at the
    measured segments' CPU seconds per token and marked ``cpu_hours_estimated``. Points without any measured segment
    keep their wall-clock figure."""
    measured: dict[int, float] = {}  # steps -> that segment's CPU seconds
    before_total = None
    for p in points:
        total = p.get("train_cpu_seconds_total")
        if total:
            measured[p["steps"]] = total - (before_total or 0.0)
        before_total = total
    segments = [(p["tokens"] - (points[i - 1]["tokens"] if i else 0), measured.get(p["steps"]))
                for i, p in enumerate(points)]
    known = [(t, c) for t, c in segments if c is not None and t and t > 0]
    if not known:
        return points
    per_token = sum(c for _, c in known) / sum(t for t, _ in known)
    running, out = 0.0, []
    for p, (tokens, cpu) in zip(points, segments):
        running += cpu if cpu is not None else per_token * (tokens or 0)
        # a curve trained from a feature cache also pays the cache's build (its share so far, run_point's bill)
        out.append({**p, "cpu_hours": (running + (p.get("cache_cpu_seconds") or 0.0)) / 3600.0,
                    "cpu_hours_estimated": cpu is None})
    return out


def tokens_per_cpu_hour(points: list[dict[str, Any]]) -> float | None:
    """Training tokens per CPU-hour over the whole run so far (the last point's totals)."""
    last = points[-1] if points else None
    if not last or not last.get("tokens") or not last.get("cpu_hours"):
        return None
    return last["tokens"] / last["cpu_hours"]


def with_cost_aware(data: dict[str, Any]) -> dict[str, Any]:
    """Every point's ``cost_aware`` shape (tau, predicted speedup) from the curve's costs, the same costs for every
    point (points evaluated before any costs, or recorded without a shape table, get none)."""
    from draftsmith.evals.curve_runner import costs_of
    from draftsmith.evals.learning_curve import cost_aware

    costs = costs_of(data)
    for p in data["points"]:
        for name in prompt_sets(data):
            record = p["eval"][name]
            if costs is not None and record.get("shapes") and "node_counts" in record["shapes"][0]:
                record["cost_aware"] = cost_aware(record["shapes"], costs)
    return data


def fits(data: dict[str, Any]) -> dict[str, Any]:
    """Per prompt set: the first-position acceptance fit and its forecast for that set's target."""
    points = [p for p in data["points"] if p.get("tokens")]
    rate = tokens_per_cpu_hour(points)
    out = {}
    for name in prompt_sets(data):
        xs = [p["tokens"] for p in points]
        ys = [p["eval"][name]["first_position_acceptance"] for p in points]
        target = {"first_position": TARGETS[name]} if name in TARGETS else {}
        covered = [p["eval"][name].get("draft_vocab_coverage") for p in points]
        coverage = min((c for c in covered if c is not None), default=None)  # the same target tokens at every point
        out[name] = {"metric": "first_position_acceptance", "coverage": coverage,
                     **forecast(fit_curve(xs, ys, coverage if coverage is not None else 1.0), target, rate, coverage)}
    return out


def _fmt(value: Any, digits: int = 3) -> str:
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
        return f"timed while other processes used {kept.get('others_cpu_share', 0):.0%} of the CPUs: contended"
    return "timed on a quiet machine"


def _cache_note(data: dict[str, Any]) -> str:
    bill = data.get("feature_cache")
    if not bill:
        return ""
    if bill.get("cpu_seconds") is None:
        return f", trained from the feature cache {bill['path']} whose build cost was not recorded (not included)"
    return (f", plus the feature cache's build ({bill['cpu_seconds'] / 3600:.2f} CPU-h for "
            f"{bill['train_tokens']:,} training tokens, billed pro rata over the first epoch)")


def best_point(data: dict[str, Any]) -> dict[str, Any] | None:
    """The point whose export reads the highest mean first-position acceptance over the held-out prompt sets (the
    checkpoint to serve: training loss keeps falling after acceptance peaks), with how far the last point is below
    it; None before the first point."""
    names = prompt_sets(data)
    scored = [(sum(p["eval"][n]["first_position_acceptance"] for n in names) / len(names), p)
              for p in data["points"] if names and all(n in p.get("eval", {}) for n in names)]
    if not scored:
        return None
    mean, best = max(scored, key=lambda sp: (sp[0], -sp[1]["steps"]))  # a tie keeps the earlier, cheaper point
    return {"steps": best["steps"], "tokens": best.get("tokens"), "mean_first_position": round(mean, 4),
            "export": f"points/step{best['steps']}/export", "last_below_by": round(mean - scored[-1][0], 4)}


def _best_line(data: dict[str, Any]) -> list[str]:
    best = data.get("best_point")
    if not best:
        return []
    fell = (f"; the last point reads {best['last_below_by']:.3f} lower: acceptance peaked before the run's end"
            if best["last_below_by"] > 0 else "")
    return ["", f"Best point by held-out acceptance: step {best['steps']} (mean first-position "
            f"{best['mean_first_position']:.3f}), export `{best['export']}`{fell}."]


def markdown(data: dict[str, Any], fit_block: dict[str, Any]) -> str:
    """The curve as a markdown table (one row per point and prompt set) plus the fit's forecast."""
    lines = [f"# Learning curve: {' '.join(data['overrides'])}", "",
             f"Machine: {data['machine']['cpu']}, {data['machine']['cores']} cores. Held-out prompts: "
             f"{data['settings']['prompts']} x {data['settings']['max_new_tokens']} new tokens, greedy, the runtime's "
             "own loop. CPU-h: the training processes' own CPU time (~: estimated at the measured segments' rate)"
             f"{_cache_note(data)}. "
             "Acceptance at depths 1-4 is per position given the earlier ones were accepted; "
             f"speedups are predicted from one set of step costs ({_costs_note(data)}).", "",
             "| steps | tokens | CPU-h | prompts | first-position | per position d1-d4 | in draft vocab "
             "| cost-aware shape | tau | predicted speedup |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in data["points"]:
        for name in prompt_sets(data):
            e = p["eval"][name]
            aware = e.get("cost_aware") or {}
            hours = _fmt(p["cpu_hours"], 2) + ("~" if p.get("cpu_hours_estimated") else "")
            lines.append(f"| {p['steps']} | {_fmt(p['tokens'])} | {hours} | {name} | "
                         f"{_fmt(e['first_position_acceptance'])} | "
                         f"{' / '.join(f'{a:.2f}' for a in e['conditional_acceptance'])} | "
                         f"{_fmt(e.get('draft_vocab_coverage'))} | "
                         f"{aware.get('shape', '-')} | {_fmt(aware.get('tau'), 2)} | "
                         f"{_fmt(aware.get('predicted_speedup'), 2)}x |")
    lines += [*_best_line(data), "", "## Fit: first-position acceptance = ceiling - scale * tokens^(-exponent)", ""]
    for name, block in fit_block.items():
        fit = block.get("fit")
        if fit is None:
            lines.append(f"- {name}: no fit ({block.get('why')})")
            continue
        bound = f" (at most {block['coverage']:.3f}, the draft vocabulary's coverage)" if block.get("coverage") else ""
        lines.append(f"- {name}: ceiling {fit['ceiling']:.3f}{bound}, exponent {fit['exponent']:.2f}, rmse "
                     f"{fit['rmse']:.3f}; flattens (< 0.01 a doubling) at {_fmt(block['flattens_at_tokens'])} tokens")
        for target in block["targets"].values():
            reach = (f"{_fmt(target['tokens'])} tokens ({_fmt(target['cpu_hours'], 1)} CPU-h)"
                     if target["reachable"] else target["why"])
            lines.append(f"  - {target['target']}: {reach}")
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], fit_block: dict[str, Any], path: Path) -> None:
    """Acceptance (first position, solid; fit, dashed) against training tokens, log x, CPU-hours on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in data["points"] if p.get("tokens")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p["tokens"] for p in points]
    for name in prompt_sets(data):
        ys = [p["eval"][name]["first_position_acceptance"] for p in points]
        line, = ax.plot(xs, ys, "o-", label=f"{name} first position")
        deeper = [p["eval"][name]["chain_acceptance"][-1] for p in points]
        ax.plot(xs, deeper, "s:", color=line.get_color(), alpha=0.6, label=f"{name} all of 4")
        fit = fit_block.get(name, {}).get("fit")
        if fit and xs:
            grid = [min(xs) * (max(xs) * 20 / min(xs)) ** (i / 60) for i in range(61)]
            ax.plot(grid, [fit["ceiling"] - fit["scale"] * g ** (-fit["exponent"]) for g in grid], "--",
                    color=line.get_color(), alpha=0.7, label=f"{name} fit (ceiling {fit['ceiling']:.2f})")
    rate = tokens_per_cpu_hour(points)
    if rate:
        top = ax.secondary_xaxis("top", functions=(lambda t: t / rate, lambda h: h * rate))
        top.set_xlabel("CPU-hours of training")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out acceptance")
    ax.set_ylim(0, 1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(curve_dir: str | Path, data: dict[str, Any]) -> dict[str, Any]:
    """Write curve.md and curve.png beside curve.json; returns the fit block (also stored in curve.json)."""
    from draftsmith.evals.curve_runner import CURVE_FILE, write_json

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


def compare(curve_dirs: list[str | Path], out: str | Path) -> dict[str, Any]:
    """Several curves (recipe choices: data, labels, TTT depth, vocabulary) side by side at equal CPU-hours:
    compare.json, compare.md and compare.png (first-position acceptance against CPU-hours, log x) in ``out``."""
    import json

    from draftsmith.evals.curve_runner import CURVE_FILE, write_json

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    curves = {str(d): json.loads((Path(d) / CURVE_FILE).read_text()) for d in curve_dirs}
    for data in curves.values():
        data["points"] = settle_cpu_hours(data["points"])
    chosen = pick(curves)
    rows = []
    for name, data in curves.items():
        for p in data["points"]:
            for prompt_set in prompt_sets(data):
                rows.append({"curve": name, "overrides": " ".join(data["overrides"]), "steps": p["steps"],
                             "tokens": p["tokens"], "cpu_hours": p["cpu_hours"], "prompts": prompt_set,
                             "first_position": p["eval"][prompt_set]["first_position_acceptance"]})
    write_json(out / "compare.json", {"curves": list(curves), "rows": rows, "pick": chosen})
    lines = ["| curve | overrides | steps | tokens | CPU-h | prompts | first-position |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {Path(r['curve']).name} | {r['overrides']} | {r['steps']} | {_fmt(r['tokens'])} | "
              f"{_fmt(r['cpu_hours'], 2)} | {r['prompts']} | {_fmt(r['first_position'])} |" for r in rows]
    (out / "compare.md").write_text("\n".join([*lines, "", *_pick_lines(chosen)]) + "\n")
    _plot_compare(rows, out / "compare.png")
    return {"curves": list(curves), "rows": len(rows), "picked": (chosen["picked"] or {}).get("curve")}


def _pick_lines(chosen: dict[str, Any]) -> list[str]:
    """The comparison at equal budgets as markdown: one row per curve, and the curve picked."""
    lines = []
    for key, label in (("equal_cpu_hours", "CPU-hours"), ("equal_tokens", "tokens")):
        block = chosen[key]
        lines += [f"At equal {label} ({_fmt(block['budget'], 3)}, the most every curve reached; interpolated on a "
                  "log axis between measured points):", "", "| curve | first-position by prompt set | mean |",
                  "|---|---|---|"]
        lines += [f"| {Path(name).name} | " + ", ".join(f"{s} {_fmt(v)}" for s, v in row["first_position"].items())
                  + f" | {_fmt(row['mean'])} |" for name, row in block["curves"].items()]
        lines.append("")
    picked = chosen["picked"]
    lines.append(f"Picked (highest mean at equal CPU-hours; `make train-best` trains it): {Path(picked['curve']).name}"
                 f" with `{' '.join(picked['overrides'])}`" if picked else "Picked: none (no common budget)")
    if picked and picked.get("decisive") is not None:
        verdict = "decisive" if picked["decisive"] else "not decisive: within the prompts' sampling noise"
        lines.append(f"Its lead over the next: {picked['margin']:.3f} against a standard error of the difference of "
                     f"{picked['noise']:.3f} (binomial over the verified steps): {verdict}.")
    return lines


def _plot_compare(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in dict.fromkeys((r["curve"], r["prompts"]) for r in rows):
        mine = [r for r in rows if (r["curve"], r["prompts"]) == key and r["cpu_hours"]]
        ax.plot([r["cpu_hours"] for r in mine], [r["first_position"] for r in mine], "o-",
                label=f"{Path(key[0]).name} / {key[1]}")
    ax.set_xscale("log")
    ax.set_xlabel("CPU-hours of training")
    ax.set_ylabel("held-out first-position acceptance")
    ax.set_ylim(0, 1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
