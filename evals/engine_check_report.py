"""``draftsmith engine-check``'s result as a markdown table: one row per engine and mode, with each
row's verdict (lossless, near-ties only, ids equal across engines)."""

from __future__ import annotations

from typing import Any

from draftsmith.evals.engine_check import LABELS


def equal_or_tied(lc: dict[str, Any]) -> str:
    """The llama.cpp speculative row's verdict on its text: equal to plain, parted only at near-ties
    (the logit gaps), or parted at a clear margin (a real loss)."""
    if lc["lossless"]:
        return "equal to plain"
    gaps = [p["gap"] for p in lc.get("divergences") or [] if p is not None]
    parted = sum(not ok for ok in lc["lossless_per_prompt"])
    if gaps and lc.get("near_ties_only"):
        return (
            f"parts from plain on {parted} prompts, each at a near-tie (logit gap <="
            f" {max(gaps):.3f})"
        )
    return f"DIFFERS: {lc['lossless_per_prompt']}" + (f", logit gaps {gaps}" if gaps else "")


def _f(value: Any, digits: int = 2) -> str:
    return (
        "n/a"
        if value is None
        else f"{value:.{digits}f}"
        if isinstance(value, float)
        else str(value)
    )


def markdown(result: dict[str, Any]) -> str:
    """The check as a markdown table: one row per engine and mode."""
    lc, ours = result["llamacpp"], result["runtime"]
    plain, spec = lc["plain"], lc["speculative"]
    label = LABELS.get(result.get("method", "eagle3"), result.get("method"))
    rows = [
        (
            "llama.cpp plain (llama-completion)",
            "",
            "",
            _f(plain["decode_tokens_per_s"]),
            _f(plain["tokens_per_s_incl_prompt"]),
            "reference",
        ),
        (
            f"llama.cpp {label} (n_max {spec['n_draft_max']})",
            _f(spec["tau"]),
            _f(spec["acceptance"]),
            _f(spec["decode_tokens_per_s"]),
            _f(spec["tokens_per_s_incl_prompt"]),
            equal_or_tied(lc),
        ),
        (
            f"draftsmith runtime AR ({ours['dtype']})",
            "",
            "",
            "",
            _f(ours["ar_tokens_per_s"]),
            f"ids = llama.cpp plain: {ours['ids_equal_llamacpp_plain']}",
        ),
        (
            f"draftsmith runtime {label} chain {spec['n_draft_max']}",
            _f(ours["tau"]),
            _f(ours["acceptance"]),
            "",
            _f(ours["speculative_tokens_per_s"]),
            "equal to runtime AR" if ours["lossless"] else "DIFFERS from AR",
        ),
    ]
    head = (
        f"{result['num_prompts']} {result['prompts']} prompts x {result['max_new_tokens']} new"
        f" tokens, {result['threads']} threads, greedy; {_prompt_ids_text(result)}\n\n| engine /"
        " mode | tau | accepted / drafted | decode tok/s | tok/s incl. prompt | tokens"
        " |\n|---|---|---|---|---|---|\n"
    )
    return head + "\n".join("| " + " | ".join(r) + " |" for r in rows)


def _prompt_ids_text(result: dict[str, Any]) -> str:
    """Which prompt ids the engines decoded from (the same in both: llama.cpp's), and where the HF
    tokenizer differs."""
    report = result.get("prompt_ids") or {}
    if not report:
        return f"prompt ids match: {result['prompt_ids_match']}"
    same = (
        "the same prompt ids in both engines (llama.cpp's tokenization)"
        if report["same_in_both_engines"]
        else (
            f"llama.cpp's prompt ids unreadable for prompts {report['llamacpp_ids_unreadable']}:"
            " ours decoded the HF tokenizer's there"
        )
    )
    differs = report["hf_tokenizer_differs"]
    return same + (f"; the HF tokenizer splits prompts {differs} differently" if differs else "")
