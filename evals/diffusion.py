"""Bench of block-diffusion decoding: baseline, Learn2PD, EoTP and both, each optionally with the
prefix KV cache.

Per mode: tokens/s (answer tokens over wall time), denoising steps per block, forwards per generated
token, the speedup over the baseline (same cache setting) and the share of prompts whose answer
equals the baseline's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from draftsmith.common.errors import InputError
from draftsmith.runtime.decoding.diffusion import (
    DiffusionDecodeConfig,
    baseline_policy,
    diffusion_decode,
    learn2pd_policy,
)
from draftsmith.runtime.target.diffusion_lm import DiffusionLM

MODES = ("baseline", "learn2pd", "eotp", "learn2pd+eotp")


def bench_modes(
    lm: DiffusionLM,
    prompts: list[list[int]],
    cfg: DiffusionDecodeConfig,
    filter_module: Any = None,
    caches: tuple[bool, ...] = (False,),
    threshold: float | None = None,
    progress: Callable[[int], None] = lambda k: None,
) -> dict[str, Any]:
    """Decode every prompt in every mode (Learn2PD modes only with a filter); returns rows and the
    answers. ``progress(1)`` is called after each decode."""
    rows, answers = [], {}
    for cache in caches:
        for mode in MODES:
            if "learn2pd" in mode and filter_module is None:
                continue
            run_cfg = replace(cfg, use_cache=cache, eotp="eotp" in mode)
            policy = (
                learn2pd_policy(filter_module, threshold) if "learn2pd" in mode else baseline_policy
            )
            results = []
            for p in prompts:
                results.append(diffusion_decode(lm, p, run_cfg, policy=policy))
                progress(1)
            name = mode + ("+cache" if cache else "")
            answers[name] = [r.answer for r in results]
            seconds = sum(r.seconds for r in results)
            tokens = sum(len(r.answer) for r in results)
            blocks = sum(len(r.block_steps) for r in results)
            base = answers.get("baseline" + ("+cache" if cache else ""), answers[name])
            rows.append(
                {
                    "mode": name,
                    "seconds": round(seconds, 3),
                    "answer_tokens": tokens,
                    "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
                    "steps": sum(r.steps for r in results),
                    "steps_per_block": round(sum(r.steps for r in results) / max(blocks, 1), 2),
                    "forwards_per_token": round(
                        sum(r.forwards for r in results) / max(tokens, 1), 3
                    ),
                    "same_as_baseline": round(
                        sum(a == b for a, b in zip(answers[name], base)) / len(prompts), 3
                    ),
                    "agreed_prefix": round(agreed_prefix(answers[name], base), 3),
                }
            )
    base_s = {
        c: next(r["seconds"] for r in rows if r["mode"] == "baseline" + ("+cache" if c else ""))
        for c in caches
    }
    base_steps = {
        c: next(r["steps"] for r in rows if r["mode"] == "baseline" + ("+cache" if c else ""))
        for c in caches
    }
    for row in rows:
        cache = row["mode"].endswith("+cache")
        row["speedup"] = round(base_s[cache] / row["seconds"], 2) if row["seconds"] else 0.0
        row["step_reduction"] = round(base_steps[cache] / max(row["steps"], 1), 2)
    return {"config": asdict(cfg), "prompts": len(prompts), "rows": rows, "answers": answers}


def agreed_prefix(answers: list[list[int]], baseline: list[list[int]]) -> float:
    """Mean share of each baseline answer that a mode reproduces before its first differing token
    (1.0 = identical; a prompt whose answers differ only after the baseline's end scores by the
    longer answer). Finer than
    ``same_as_baseline``: one early divergence and one at the last token both make an answer
    "different".
    """
    shares = []
    for a, b in zip(answers, baseline):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shares.append(1.0 if a == b else same / max(len(a), len(b)))
    return sum(shares) / max(len(shares), 1)


def format_table(result: dict[str, Any]) -> str:
    """The bench rows as an aligned text table."""
    cols = (
        "mode",
        "tokens_per_s",
        "steps",
        "steps_per_block",
        "forwards_per_token",
        "speedup",
        "step_reduction",
        "same_as_baseline",
        "agreed_prefix",
    )
    lines = ["  ".join(f"{c:>18}" for c in cols)]
    lines += ["  ".join(f"{str(row[c]):>18}" for c in cols) for row in result["rows"]]
    return "\n".join(lines)


def add_task_accuracy(
    result: dict[str, Any], records: list[dict], decode: Callable[[list[int]], str]
) -> None:
    """Each row's ``task_accuracy``: the exact-match share over the prompts that have a checkable
    ``answer``."""
    from draftsmith.datagen.rewards import exact_match

    checkable = [i for i, r in enumerate(records) if r.get("answer") is not None]
    for row in result["rows"]:
        answers = result["answers"][row["mode"]]
        hits = [exact_match(records[i], decode(answers[i])) for i in checkable]
        row["task_accuracy"] = round(sum(hits) / len(hits), 3) if hits else None
    result["checkable_prompts"] = len(checkable)


def markdown_table(result: dict[str, Any]) -> str:
    """The bench rows as markdown (what the README and ``--out``'s .md hold)."""
    cols = (
        "mode",
        "tokens_per_s",
        "steps_per_block",
        "forwards_per_token",
        "speedup",
        "step_reduction",
        "same_as_baseline",
        "agreed_prefix",
    ) + (("task_accuracy",) if "task_accuracy" in result["rows"][0] else ())
    out = "| " + " | ".join(c.replace("_", " ") for c in cols) + " |\n|" + "---|" * len(cols) + "\n"
    return out + "".join(
        "| " + " | ".join(str(row[c]) for c in cols) + " |\n" for row in result["rows"]
    )


def run_cli(args: Any) -> dict[str, Any]:
    """``draftsmith bench --target DLM [--filter EXPORT]``: every mode over the
    prompts with a progress bar; prints the table, writes JSON (and a markdown twin) with ``--out``.
    """
    import torch
    from tqdm import tqdm

    from draftsmith.runtime.target.diffusion_lm import supports_prefix_cache

    caches = {"off": (False,), "on": (True,), "both": (False, True)}[args.cache]
    if args.threshold is not None and (args.filter is None or not 0 < args.threshold < 1):
        raise InputError(
            f"--threshold {args.threshold}: it is the Learn2PD filter's acceptance probability, so"
            " it needs --filter EXPORT and a value strictly between 0 and 1"
        )
    if args.threads:
        torch.set_num_threads(int(args.threads))
    lm, filt = _load_target_and_filter(args)
    steps = args.steps_per_block or (
        filt.config.steps_per_block if filt is not None else lm.spec.block_length
    )
    records, prompts = _bench_prompts(args, lm.tokenizer)
    cfg = DiffusionDecodeConfig(
        gen_length=args.gen_length, steps_per_block=steps, temperature=args.temperature
    )
    # before any decode, not after the uncached modes
    if True in caches and not supports_prefix_cache(lm.spec):
        raise InputError(
            f"--cache {args.cache}: {args.target} has no exact prefix cache (full attention or no"
            " shift, e.g. LLaDA or Dream); use --cache off"
        )
    modes = sum(1 for m in MODES if filt is not None or "learn2pd" not in m) * len(caches)
    with tqdm(total=modes * len(prompts), desc="diffusion bench", unit="decode") as bar:
        result = bench_modes(
            lm, prompts, cfg, filt, caches=caches, threshold=args.threshold, progress=bar.update
        )
    result["target"], result["filter"] = str(args.target), args.filter
    if records is not None:
        add_task_accuracy(
            result, records, lambda ids: lm.tokenizer.decode(ids, skip_special_tokens=True)
        )
    first = result["rows"][0]["mode"]  # baseline or baseline+cache
    result["samples"] = [lm.tokenizer.decode(a) for a in result["answers"][first][:3]]
    _print_and_write(result, args.out)
    return result


def _load_target_and_filter(args: Any) -> tuple[Any, Any]:
    """The diffusion target of ``--target`` and the Learn2PD filter of ``--filter`` (or None)."""
    from draftsmith.common.dtypes import dtype_from_name
    from draftsmith.controllers.learn2pd import Learn2PDFilter
    from draftsmith.runtime.target.diffusion_lm import load_diffusion_lm

    lm = load_diffusion_lm(
        args.target,
        dtype=dtype_from_name(args.dtype),
        trust_remote_code=bool(getattr(args, "trust_remote_code", False)),
    )
    if not args.filter:
        return lm, None
    return lm, Learn2PDFilter.from_export(args.filter, block_length=lm.spec.block_length)[0]


def _bench_prompts(args: Any, tokenizer: Any) -> tuple[list[dict] | None, list[list[int]]]:
    """``(records, prompt ids)``: the mixed task (``embedded...``: some prompts have a checkable
    answer, so records come back for the task accuracy) or a prompt set (records None)."""
    from draftsmith.common.chat import encode_chat
    from draftsmith.common.prompt_sets import encode_prompts
    from draftsmith.datagen.mixed_task import load_prompt_records

    if not str(args.prompts).startswith("embedded"):
        return None, encode_prompts(args.prompts, tokenizer, args.limit)
    records = load_prompt_records(args.prompts, args.limit)
    return records, [
        encode_chat(tokenizer, [{"role": "user", "content": r["text"]}]) for r in records
    ]


def _print_and_write(result: dict[str, Any], out: str | None) -> None:
    """Print the table and the first baseline answers; write JSON and its markdown twin to
    ``out``."""
    import json
    from pathlib import Path

    print(format_table(result))
    for i, text in enumerate(result["samples"]):
        print(f"--- baseline answer {i}: {text[:300]!r}")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
        Path(out).with_suffix(".md").write_text(markdown_table(result))
