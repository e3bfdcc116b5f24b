"""The bench's report: the markdown table printed and written to ``bench.md``, ``bench.json`` and
the PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith.bench import contention, served, windows
from draftsmith.bench.report_tables import cell, tables_under_summary


def _parity_rows(section: list[dict[str, Any]] | None) -> list[tuple[str, str]]:
    """The engine-parity rows, importing the engine routes only when a bench ran them (the serving
    walk stays short)."""
    if not section:
        return []
    from draftsmith.bench import engine_parity

    return engine_parity.markdown_rows(section)


def _inference_text(inference: dict | None) -> str:
    if not inference:
        return "n/a"
    v, p = inference["verifier"], inference["stop_policy"]
    return f"{v['name']} ({v['source']}) / {p['spec']} ({p['source']})"


def _speedup_text(result: dict[str, Any]) -> str:
    """The speedup over runtime AR with its 95% interval over prompts; for plain serving, why a gap
    is noise."""
    s = result["speedup"]
    text = cell(s["vs_runtime_ar"])
    lo, hi = s.get("vs_runtime_ar_ci95") or (None, None)
    if lo is not None:  # None when one prompt was timed
        text += f" [{lo:.2f}, {hi:.2f}] (95% CI, prompts resampled)"
    if result.get("served_plain"):
        text += (
            "; served plain decoding runs the runtime AR loop itself, so any gap is timing noise"
        )
    return text


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
                    f"{cell(row['decode_tokens_per_s'], 1)} decode;"
                    f" {cell(row['tokens_per_s_incl_prompt'], 1)} incl. prompt eval (as runtime"
                    f" AR); prompt eval {cell(row['prompt_tokens_per_s'], 0)}; {row['threads']}"
                    f" threads, {same[row['prompt_ids_match']]}"
                ),
            )
        )
        ratios.append(
            f"{label} {cell(_over(ar, row['tokens_per_s_incl_prompt']))} "
            f"(decode-only {cell(_over(ar, row['decode_tokens_per_s']))})"
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
    return rows + ([("machine while timing", contention.verdict_text(busy))] if busy else [])


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
    rows = [
        *_setup_rows(result),
        *_acceptance_rows(result),
        *_speed_rows(result),
        *_step_cost_rows(result["step_costs"]),
        ("lossless (greedy spec == greedy HF generate)", served.lossless_text(result)),
        *_parity_rows(result.get("engine_parity")),
        *_cost_model_rows(result.get("cost_model")),
        *_run_rows(result),
        *_verify_reuse_rows(result.get("verify_reuse")),
        *_target_change_rows(result.get("target_change")),
    ]
    text = "| metric | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"
    return text + tables_under_summary(result)


def _setup_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """What ran: the method, the prompts, the CPU, dtypes and backends, and what was served."""
    b = result.get("backend") or {}
    return [
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
    ]


def _acceptance_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """Tau, acceptance by draft position and by output window, and the heads' top-1 agreement."""
    return [
        ("tau (mean accepted length, incl. bonus)", served.tau_text(result)),
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
    ]


def _speed_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """Tokens/s of HF generate, runtime AR and speculative decoding (and llama.cpp), and the
    speedups between them."""
    t, s = result["tokens_per_s"], result["speedup"]
    return [
        (f"HF generate tokens/s ({result.get('hf_dtype')})", cell(t["hf_generate"], 1)),
        (f"runtime AR tokens/s ({result['dtype']})", cell(t["runtime_ar"], 1)),
        ("speculative tokens/s", cell(t["speculative"], 1)),
        *_peer_rows(result),
        ("speedup vs HF generate", cell(s["vs_hf_generate"])),
        ("speedup vs runtime AR", _speedup_text(result)),
        ("runtime AR vs HF generate", cell(s["runtime_ar_vs_hf_generate"])),
    ]


def _step_cost_rows(c: dict[str, Any]) -> list[tuple[str, str]]:
    """One AR step and one verify forward, the AR step against its bandwidth floor, the speedup
    they predict, and the forward curve."""
    return [
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
            cell(c["predicted_speedup_tau_x_step_over_verify"]),
        ),
        (
            "forward ms for "
            + "/".join(str(t) for t in c.get("forward_ms_by_new_tokens", {}))
            + " new tokens",
            " / ".join(f"{v:.1f}" for v in c.get("forward_ms_by_new_tokens", {}).values()) or "n/a",
        ),
    ]


def _verify_reuse_rows(reuse: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Kangaroo: the share of verify compute the shallow cache saved."""
    if not reuse:
        return []
    return [
        (
            "verify compute saved by the shallow cache (Kangaroo)",
            (
                f"{reuse['verify_compute_saved']:.1%} ({reuse['reused_tokens']} of"
                f" {reuse['verified_tokens']} verified tokens skipped the shallow layers)"
            ),
        )
    ]


def _target_change_rows(change: dict[str, Any] | None) -> list[tuple[str, str]]:
    """An export that changes its target (Medusa-2): why, its perplexity against the original's, and
    its greedy agreement with the original."""
    if not change:
        return []
    rows = [
        ("LOSSY: export changes the target", change["why"]),
        (
            "perplexity on held-out data: adapted / original",
            (
                f"{change['perplexity_adapted']:.2f} / {change['perplexity_original']:.2f} "
                f"({change['held_out_conversations']} conversations)"
            ),
        ),
    ]
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
    return rows


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
