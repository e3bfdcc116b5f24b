"""Several learning curves side by side (``draftsmith curve --compare A,B --out DIR``): each read at
equal CPU-hours and equal tokens on its cooled points (raw where a curve has none), the pick,
compare.json / compare.md / compare.png."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftsmith.evals.curve_pick import pick, reading_points


def compare(curve_dirs: list[str | Path], out: str | Path) -> dict[str, Any]:
    """Several curves (recipe choices: data, labels, TTT depth, vocabulary) side by side at equal
    CPU-hours: compare.json, compare.md and compare.png (first-position acceptance against
    CPU-hours, log x) in ``out``. Each curve is read on its cooled points (each predicts a finished
    run), raw where it has none (the table says which).
    """
    from draftsmith.evals.curve_folder import CURVE_FILE, read_curve, write_json
    from draftsmith.evals.curve_report import settle_cpu_hours

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    curves = {str(d): read_curve(Path(d) / CURVE_FILE) for d in curve_dirs}
    for data in curves.values():
        data["points"] = settle_cpu_hours(data["points"])
    chosen = pick(curves)
    rows = [row for name, data in curves.items() for row in _rows(name, data)]
    write_json(out / "compare.json", {"curves": list(curves), "rows": rows, "pick": chosen})
    lines = _table_lines(rows)
    (out / "compare.md").write_text("\n".join([*lines, *_pick_lines(chosen)]) + "\n")
    _plot_compare(rows, out / "compare.png")
    return {
        "curves": list(curves),
        "rows": len(rows),
        "picked": (chosen["picked"] or {}).get("curve"),
    }


def _rows(name: str, data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per point and prompt set of curve ``name``, read on its cooled points (raw where it
    has none)."""
    from draftsmith.evals.curve_report import prompt_sets

    points, values = reading_points(data)
    return [
        {
            "curve": name,
            "overrides": " ".join(data["overrides"]),
            "values": values,
            "steps": p["steps"],
            "tokens": p["tokens"],
            "cpu_hours": p["cpu_hours"],
            "prompts": prompt_set,
            "first_position": p["eval"][prompt_set]["first_position_acceptance"],
        }
        for p in points
        for prompt_set in prompt_sets(data)
    ]


def _table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The rows as a markdown table, then a blank line, and a note when some curves are read raw."""
    from draftsmith.evals.curve_report import fmt_value

    lines = [
        "| curve | overrides | read | steps | tokens | CPU-h | prompts | first-position |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {Path(r['curve']).name} | {r['overrides']} | {r['values']} | {r['steps']} | "
        f"{fmt_value(r['tokens'])} | {fmt_value(r['cpu_hours'], 2)} | {r['prompts']} | "
        f"{fmt_value(r['first_position'])} |"
        for r in rows
    ]
    lines.append("")
    if len({r["values"] for r in rows}) > 1:
        lines += [
            "Some curves have no cooled points and are read raw (mid-run, constant LR): raw"
            " values understate a finished run, so the comparison favours the cooled curves.",
            "",
        ]
    return lines


def _pick_lines(chosen: dict[str, Any]) -> list[str]:
    """The comparison at equal budgets as markdown: one row per curve, and the curve picked."""
    from draftsmith.evals.curve_report import fmt_value

    lines = []
    for key, label in (("equal_cpu_hours", "CPU-hours"), ("equal_tokens", "tokens")):
        block = chosen[key]
        lines += [
            (
                f"At equal {label} ({fmt_value(block['budget'], 3)}, the most every curve reached;"
                " interpolated on a log axis between the readings, cooled where a curve has them):"
            ),
            "",
            "| curve | read | first-position by prompt set | mean |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {Path(name).name} | {row.get('values', 'raw')} | "
            + ", ".join(f"{s} {fmt_value(v)}" for s, v in row["first_position"].items())
            + f" | {fmt_value(row['mean'])} |"
            for name, row in block["curves"].items()
        ]
        lines.append("")
    picked = chosen["picked"]
    lines.append(
        "Picked (highest mean at equal CPU-hours; `make train-best` trains it):"
        f" {Path(picked['curve']).name} with `{' '.join(picked['overrides'])}`"
        if picked
        else "Picked: none (no common budget)"
    )
    if picked and picked.get("decisive") is not None:
        verdict = (
            "decisive" if picked["decisive"] else "not decisive: within the prompts' sampling noise"
        )
        lines.append(
            f"Its lead over the next: {picked['margin']:.3f} against a standard error of the"
            f" difference of {picked['noise']:.3f} (binomial over the verified steps): {verdict}."
        )
    return lines


def _plot_compare(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in dict.fromkeys((r["curve"], r["prompts"]) for r in rows):
        mine = [r for r in rows if (r["curve"], r["prompts"]) == key and r["cpu_hours"]]
        ax.plot(
            [r["cpu_hours"] for r in mine],
            [r["first_position"] for r in mine],
            "o-",
            label=f"{Path(key[0]).name} / {key[1]}",
        )
    ax.set_xscale("log")
    ax.set_xlabel("CPU-hours of training")
    ax.set_ylabel("held-out first-position acceptance")
    ax.set_ylim(0, 1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
