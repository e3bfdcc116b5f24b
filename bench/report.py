"""The bench's report: the markdown table printed and written to ``bench.md``, ``bench.json`` and
the PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith.bench import windows


def _fmt(value: Any, digits: int = 2) -> str:
    return (
        "n/a"
        if value is None
        else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))
    )


def _parity_rows(section: list[dict[str, Any]] | None) -> list[tuple[str, str]]:
    """The engine-parity rows, importing the engine routes only when a bench ran them (the serving
    walk stays short)."""
    if not section:
        return []
    from draftsmith.bench import engine_parity

    return engine_parity.markdown_rows(section)


def _lossless_text(result: dict[str, Any]) -> str:
    """The lossless cell: the verdict, its counts and dtype, and what it ran (the drafter, whatever
    was served)."""
    detail = result.get("lossless_detail")
    if not detail:
        return "not checked (sampling or lossy verifier)"
    text = (
        f"{result['lossless']} ({detail['identical']}/{detail['total']} prompts identical,"
        f" {detail['dtype']})"
    )
    if detail.get("checked"):
        tau = detail.get("tau")
        text += f"; checked: {detail['checked']}" + (f", tau {tau:.3f}" if tau is not None else "")
    oracle = detail.get("oracle")
    if oracle:  # the oracle beside the drafter: accepted drafts verified on most steps
        text += (
            f"; oracle (acceptance {oracle['acceptance']:g}, chain {oracle['chain']}):"
            f" {oracle['all_identical']} ({oracle['identical']}/{oracle['total']}), tau"
            f" {_fmt(oracle['tau'], 3)}"
        )
    return text


def _tau_text(result: dict[str, Any]) -> str:
    """Tau of the served policy; where plain decoding was served it has none, and the drafter's
    checked tau is shown."""
    if not result.get("served_plain"):
        return _fmt(result["tau"], 3)
    checked = (result.get("lossless_detail") or {}).get("tau")
    return "n/a: plain decoding was served (nothing drafted)" + (
        f"; the drafter's tau in the lossless check: {checked:.3f}" if checked is not None else ""
    )


def _inference_text(inference: dict | None) -> str:
    if not inference:
        return "n/a"
    v, p = inference["verifier"], inference["stop_policy"]
    return f"{v['name']} ({v['source']}) / {p['spec']} ({p['source']})"


def _speedup_text(result: dict[str, Any]) -> str:
    """The speedup over runtime AR with its 95% interval over prompts; for plain serving, why a gap
    is noise."""
    s = result["speedup"]
    text = _fmt(s["vs_runtime_ar"])
    lo, hi = s.get("vs_runtime_ar_ci95") or (None, None)
    if lo is not None:  # None when one prompt was timed
        text += f" [{lo:.2f}, {hi:.2f}] (95% CI, prompts resampled)"
    if result.get("served_plain"):
        text += (
            "; served plain decoding runs the runtime AR loop itself, so any gap is timing noise"
        )
    return text


def _contention_text(busy: dict[str, Any]) -> str:
    """CONTENDED with the reason, or quiet, with the readings behind the verdict."""
    share = busy.get("others_cpu_share")
    readings = (
        f"others used {'n/a' if share is None else f'{share:.0%}'} of {busy['cpus']} CPUs; own"
        f" CPU/wall {busy['own_cpu_over_wall']:.2f}; load {busy.get('load_average_1m')}"
    )
    return (
        f"**CONTENDED**: {busy['why']} ({readings})"
        if busy.get("contended")
        else f"quiet ({readings})"
    )


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _peer_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """``bench --llamacpp``: llama.cpp's tokens/s per weight file and runtime AR over it
    (``peers.llamacpp``)."""
    peer = (result.get("peers") or {}).get("llamacpp")
    if not peer:
        return []
    if "skipped" in peer:
        return [("llama.cpp tok/s", f"skipped: {peer['skipped']}")]
    rows, ratios, ar = [], [], result["tokens_per_s"]["runtime_ar"]
    for key, label in (("q4_1", "Q4_1"), ("bf16", "BF16")):
        row = peer.get(key) or {"skipped": "not run"}
        if "skipped" in row:
            rows.append((f"llama.cpp {label} tok/s", f"skipped: {row['skipped']}"))
            continue
        same = {True: "same prompt ids", False: "PROMPT IDS DIFFER", None: "prompt ids unchecked"}
        rows.append(
            (
                f"llama.cpp {label} tok/s",
                (
                    f"{_fmt(row['decode_tokens_per_s'], 1)} decode;"
                    f" {_fmt(row['tokens_per_s_incl_prompt'], 1)} incl. prompt eval (as runtime"
                    f" AR); prompt eval {_fmt(row['prompt_tokens_per_s'], 0)}; {row['threads']}"
                    f" threads, {same[row['prompt_ids_match']]}"
                ),
            )
        )
        ratios.append(
            f"{label} {_fmt(_over(ar, row['tokens_per_s_incl_prompt']))} "
            f"(decode-only {_fmt(_over(ar, row['decode_tokens_per_s']))})"
        )
    if ratios:
        rows.append(("runtime AR / llama.cpp (both incl. prompt eval)", "; ".join(ratios)))
    return rows


def _cost_model_rows(cm: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The cost-aware shape choice and, for SpecDec++, the threshold it derived from the machine's
    costs."""
    if not cm:
        return []
    rows = [("cost-aware shape (calibrated on this machine)", cm["summary"])]
    if cm.get("cached") is False:
        rows.append(("calibration NOT CACHED", cm.get("not_cached_why", "contended")))
    if cm.get("learned_threshold"):
        lt = cm["learned_threshold"]
        rows.append(
            (
                "SpecDec++ threshold h (from costs)",
                f"{lt['h']:.2f} (export: {lt['was']}): {lt['why']}",
            )
        )
    return rows


def _run_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """How the run went: its phases and their times, and whether the machine was quiet while
    timing."""
    from draftsmith.bench.progress import phases_text

    rows = (
        [("phases run (time each)", phases_text(result["phases"]))] if result.get("phases") else []
    )
    busy = result.get("contention")
    return rows + ([("machine while timing", _contention_text(busy))] if busy else [])


def _draft_plan_rows(backend: dict[str, Any]) -> list[tuple[str, str]]:
    """What of the draft step runs natively and why not the rest (EAGLE proposers'
    ``draft_plan``)."""
    plan = backend.get("draft_plan")
    return (
        [("draft step (what runs natively)", "; ".join(f"{k}: {v}" for k, v in plan.items()))]
        if plan
        else []
    )


def markdown_table(result: dict[str, Any]) -> str:
    """The human-readable summary printed by ``draftsmith bench`` and written to ``bench.md``."""
    t, s, c = result["tokens_per_s"], result["speedup"], result["step_costs"]
    b = result.get("backend") or {}
    rows = [
        ("method", result["method"]),
        ("prompts x max new tokens", f"{result['prompts']} x {result['max_new_tokens']}"),
        ("CPU", b.get("cpu", "n/a")),
        (
            "dtype / verifier / linears",
            f"{result['dtype']} / {result['verifier']} / {result.get('linear_backend')}",
        ),
        ("why these linears", b.get("linear_reason", "n/a")),
        (
            "decoder (why)",
            f"{b.get('decoder_backend') or 'n/a'} ({b.get('decoder_reason') or 'n/a'})",
        ),
        *_draft_plan_rows(b),
        ("verifier / stop policy (source)", _inference_text(result.get("inference"))),
        ("served (what the timed speculative rows ran)", result.get("served", "n/a")),
        ("tau (mean accepted length, incl. bonus)", _tau_text(result)),
        (
            "acceptance by position (P(d accepted given d drafted))",
            ", ".join(f"{a:.2f}" for a in result["acceptance_by_position"]),
        ),
        (
            (
                f"tau by output window ({result.get('tau_window_tokens')} tokens; steps count where"
                " they start)"
            ),
            windows.windows_text(
                result.get("tau_by_window"), "n/a (no drafts: plain decoding has no tau)"
            ),
        ),
        (
            "head top-1 agreement with target greedy",
            ", ".join(f"{a:.2f}" for a in result["head_agreement_top1"] or []) or "n/a",
        ),
        (f"HF generate tokens/s ({result.get('hf_dtype')})", _fmt(t["hf_generate"], 1)),
        (f"runtime AR tokens/s ({result['dtype']})", _fmt(t["runtime_ar"], 1)),
        ("speculative tokens/s", _fmt(t["speculative"], 1)),
        *_peer_rows(result),
        ("speedup vs HF generate", _fmt(s["vs_hf_generate"])),
        ("speedup vs runtime AR", _speedup_text(result)),
        ("runtime AR vs HF generate", _fmt(s["runtime_ar_vs_hf_generate"])),
        (
            "one AR step / one verify forward (ms)",
            (
                f"{c['ar_step_ms']:.1f} / {c['verify_forward_ms']:.1f} "
                f"({c['tree_nodes']} nodes; LM head: {c.get('lm_head', 'logits')})"
            ),
        ),
        (
            "one AR step vs bandwidth floor",
            (
                f"{c['ar_step_ms']:.1f} ms vs {c['bandwidth_floor_ms']:.1f} ms"
                f" ({c['weight_bytes_per_step'] / 1e6:.0f} MB at {c['read_bandwidth_gbs']:.1f}"
                f" GB/s): {c['ar_step_over_floor']:.2f}x"
                if "bandwidth_floor_ms" in c
                else "n/a"
            ),
        ),
        (
            "tau x step/verify (predicted speedup)",
            _fmt(c["predicted_speedup_tau_x_step_over_verify"]),
        ),
        (
            "forward ms for "
            + "/".join(str(t) for t in c.get("forward_ms_by_new_tokens", {}))
            + " new tokens",
            " / ".join(f"{v:.1f}" for v in c.get("forward_ms_by_new_tokens", {}).values()) or "n/a",
        ),
        ("lossless (greedy spec == greedy HF generate)", _lossless_text(result)),
        *_parity_rows(result.get("engine_parity")),
    ]
    rows += _cost_model_rows(result.get("cost_model"))
    rows += _run_rows(result)
    reuse = result.get("verify_reuse")
    if reuse:
        rows.append(
            (
                "verify compute saved by the shallow cache (Kangaroo)",
                (
                    f"{reuse['verify_compute_saved']:.1%} ({reuse['reused_tokens']} of"
                    f" {reuse['verified_tokens']} verified tokens skipped the shallow layers)"
                ),
            )
        )
    change = result.get("target_change")
    if change:
        rows.append(("LOSSY: export changes the target", change["why"]))
        rows.append(
            (
                "perplexity on held-out data: adapted / original",
                (
                    f"{change['perplexity_adapted']:.2f} / {change['perplexity_original']:.2f} "
                    f"({change['held_out_conversations']} conversations)"
                ),
            )
        )
        if "greedy_token_agreement_with_original" in change:
            rows.append(
                (
                    "greedy agreement with the original target",
                    (
                        f"{change['greedy_token_agreement_with_original']:.3f}"
                        f" of tokens, {change['identical_outputs']} outputs identical"
                    ),
                )
            )
    text = "| metric | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"
    return text + _sections(result) + _oracle_section(result)


def _oracle_section(result: dict[str, Any]) -> str:
    """``bench --oracle-acceptance``: the drafter's row beside the oracle's (imported only when a
    bench ran one)."""
    if not result.get("oracle"):
        return ""
    from draftsmith.bench.oracle import markdown_section

    return markdown_section(result)


def _sections(result: dict[str, Any]) -> str:
    """The optional tables: cost-model predictions, the fixed-K sweep, the per-step profile."""
    out = ""
    cm = result.get("cost_model")
    if cm:
        out += _shape_rows(cm)
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
        out += _floor_rows(prof.get("floors"), prof.get("verdicts") or [])
    return out


def _floor_rows(floors: dict[str, Any] | None, verdicts: list[str]) -> str:
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
            f"draft call ({_fmt(floors['draft_calls_per_step'])} per step, "
            f"{floors['draft_call_bytes']['total'] / 1e6:.2f} MB)"
        ),
        "draft_per_token": f"drafted token ({_fmt(floors['drafted_tokens_per_step'])} per step)",
    }
    for key, label in labels.items():
        row = floors[key]
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        target = "" if row.get("target") is None else f"<= {row['target']}x"
        out += (
            f"| {label} | {_fmt(row['measured_ms'], 3)} | {_fmt(row['floor_ms'], 3)} | {ratio} |"
            f" {target} |\n"
        )
    return out + ("\n" if verdicts else "") + "".join(f"- {line}\n" for line in verdicts)


def _shape_rows(cm: dict[str, Any]) -> str:
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


def write_outputs(result: dict[str, Any], out_dir: str | Path) -> Path:
    """Write bench.json, bench.md and acceptance.png (acceptance by position; beside it, when the
    run drafted, tau by output window) into ``out_dir``."""
    from draftsmith.common.atomic_folder import write_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # each file written beside and renamed in: a full disk leaves the old file (or none), never a
    # 0-byte one
    write_file(out / "bench.json", json.dumps(result, indent=2) + "\n")
    write_file(out / "bench.md", markdown_table(result))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_window = result.get("tau_by_window")
    fig, axes = plt.subplots(
        1, 2 if by_window else 1, figsize=(10 if by_window else 5, 3.2), squeeze=False
    )
    ax = axes[0][0]
    curve = result["acceptance_by_position"]
    ax.bar(range(1, len(curve) + 1), curve, color="#3b7dd8")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | reached)")
    ax.set_ylim(0, 1)
    ax.set_title(
        f"{result['method']}: tau={result['tau']:.2f}, x{result['speedup']['vs_runtime_ar']:.2f}"
        " vs AR"
    )
    if by_window:  # one line per drafter: this bench runs one
        windows.plot_windows(axes[0][1], {result["method"]: by_window})
        axes[0][1].set_title(f"tau by output window ({result.get('tau_window_tokens')} tokens)")
    fig.tight_layout()
    write_file(out / "acceptance.png", lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return out
