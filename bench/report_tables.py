"""The tables under the bench report's summary (``bench.md``): the cost model's draft shapes, the
fixed-depth sweep, the per-step profile against its bandwidth floors, and the oracle's section; and
:func:`cell`, the one way a bench table writes a number."""

from __future__ import annotations

from typing import Any


def cell(value: Any, digits: int = 2) -> str:
    """One table cell: ``n/a`` for None, a float to ``digits`` decimals, anything else as text."""
    return (
        "n/a"
        if value is None
        else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))
    )


def _oracle_section(result: dict[str, Any]) -> str:
    """``bench --oracle-acceptance``: the drafter's row beside the oracle's (imported only when a
    bench ran one)."""
    if not result.get("oracle"):
        return ""
    from draftsmith.bench.oracle import markdown_section

    return markdown_section(result)


def tables_under_summary(result: dict[str, Any]) -> str:
    """The optional tables: cost-model predictions, the fixed-K sweep, the per-step profile, and the
    oracle's section."""
    out = ""
    cm = result.get("cost_model")
    if cm:
        out += shape_table(cm)
    if result.get("sweep"):
        out += "\n| stop policy | tau | tokens/s | vs runtime AR |\n|---|---|---|---|\n"
        out += "".join(
            f"| {r['policy']} | {r['tau']:.2f} | {r['tokens_per_s']:.1f}"
            f" | {r['speedup_vs_runtime_ar']:.2f} |\n"
            for r in result["sweep"]
        )
    prof = result.get("profile")
    if prof:
        parts = [k for k in prof if k.endswith("_ms") and k not in ("step_ms",)]
        out += (
            "\n| per speculative step (ms) | "
            + " | ".join(k[:-3] for k in parts)
            + " | whole step |\n"
        )
        out += "|---" * (len(parts) + 2) + "|\n"
        out += (
            f"| mean over {prof['steps']} steps | "
            + " | ".join(f"{prof[k]:.2f}" for k in parts)
            + f" | {prof['step_ms']:.2f} |\n"
        )
        if prof.get("profiled"):
            out += f"\nProfiled: {prof['profiled']}.\n"
        out += _floor_table(prof.get("floors"), prof.get("verdicts") or [])
    return out + _oracle_section(result)


def _floor_table(floors: dict[str, Any] | None, verdicts: list[str]) -> str:
    """``bench --profile``: the AR step, the verify forward and drafting against their bandwidth
    floors, then one verdict line per target."""
    if not floors:
        return ""
    out = (
        f"\n| vs bandwidth floor ({floors['bandwidth_gbs']:.1f} GB/s read, {floors['threads']}"
        f" threads, {floors['cpu']}) | measured ms | floor ms | ratio | target"
        " |\n|---|---|---|---|---|\n"
    )
    labels = {
        "ar_step": f"AR step (decode only, {floors['ar_step_bytes']['total'] / 1e6:.1f} MB)",
        "verify_forward": f"verify forward ({floors['verify_forward']['new_tokens']} tokens)",
        "draft_per_call": (
            f"draft call ({cell(floors['draft_calls_per_step'])} per step, "
            f"{floors['draft_call_bytes']['total'] / 1e6:.2f} MB)"
        ),
        "draft_per_token": f"drafted token ({cell(floors['drafted_tokens_per_step'])} per step)",
    }
    for key, label in labels.items():
        row = floors[key]
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        target = "" if row.get("target") is None else f"<= {row['target']}x"
        out += (
            f"| {label} | {cell(row['measured_ms'], 3)} | {cell(row['floor_ms'], 3)} | {ratio} |"
            f" {target} |\n"
        )
    return out + ("\n" if verdicts else "") + "".join(f"- {line}\n" for line in verdicts)


def shape_table(cm: dict[str, Any]) -> str:
    """The cost model's table: plain, every timed shape and the best predicted ones, predicted next
    to measured (the calibration's prediction, then the one refitted on the timed steps), and how
    the overhead was refitted.
    """
    rows = [r for i, r in enumerate(cm["table"]) if i < 9 or r.get("measured_speedup") is not None]
    out = (
        "\n| draft shape | nodes | tokens/step predicted (measured) | step ms predicted (measured)"
        " | predicted speedup (calibration -> refit) | measured speedup (decode only)"
        " |\n|---|---|---|---|---|---|\n"
    )
    for r in rows:
        chosen = " <- chosen" if r["shape"] == cm.get("shape_label") else ""
        measured = r.get("measured_speedup")
        first = r.get("predicted_speedup_calibration")
        predicted = (
            f"{r['predicted_speedup']:.2f}"
            if first is None or r["shape"] == "plain"
            else f"{first:.2f} -> {r['predicted_speedup']:.2f}"
        )
        tokens, step = f"{r['tokens']:.2f}", f"{r['step_ms']:.2f}"
        if r.get("measured_step_ms") is not None:
            tokens, step = (
                f"{tokens} ({r['measured_tokens']:.2f})",
                f"{step} ({r['measured_step_ms']:.2f})",
            )
        out += (
            f"| {r['shape']}{chosen} | {r['nodes']:.1f} | {tokens} | {step} | {predicted} | "
            f"{'not timed' if measured is None else f'{measured:.2f}'}{_decode_only(r)} |\n"
        )
    if len(cm["table"]) > len(rows):
        out += (
            f"| ({len(cm['table']) - len(rows)} more candidates predicted, see bench.json) | | | |"
            " | |\n"
        )
    refit, costs = cm.get("refit"), cm.get("costs")
    if refit and costs:
        was = refit["calibration_costs"]["overhead_ms"]
        out += (
            f"\nOverhead refitted on the timed steps: {costs['overhead_ms']:.2f} ms +"
            f" {costs['overhead_per_node_ms']:.3f} ms per node (the calibration's {was:.2f} ms a"
            f" step); verify curve scaled x{refit['curve_scale']:.3f} to the loop's plain step;"
            f" {refit['rounds']} timing round(s).\n"
        )
    return out


def _decode_only(row: dict[str, Any]) -> str:
    """`` (0.84)``: a timed shape's speedup with the prefills taken out (what the prediction
    describes)."""
    decode = row.get("measured_decode_speedup")
    return "" if decode is None or row["shape"] == "plain" else f" ({decode:.2f})"
