"""Run an export inside an engine people serve with and check it there: llama.cpp (``draftsmith
engine-check``).

On the same chat prompts (the bench's, rendered to text for llama.cpp as ``bench/llamacpp.py``
does), greedy, from the same token ids in both engines: llama.cpp's tools take text, and its
tokenizer splits some texts unlike the HF tokenizer (``"\\n 3"``), so the runtime is fed the ids
llama.cpp's ``--verbose-prompt`` lists (``prompt_ids`` says where the HF tokenizer differs):

- llama.cpp plain: ``llama-completion`` on the target GGUF (its own greedy tokens and decode rate);
- llama.cpp speculative: ``llama-speculative-simple -m TARGET -md DRAFT --spec-type draft-eagle3
  --spec-draft-n-max N`` (``draft-dflash`` for a DFlash export, N defaulting to ``block_size - 1``:
  llama.cpp's DFlash block is ``N + 1`` tokens, non-causal, so only then are its drafts the trained
  block's): its ``n_drafted`` / ``n_accept`` / ``n_predict`` counters give its acceptance rate and
  its tau (``n_predict`` tokens over ``n_predict - n_accept`` verify steps), its decode time the
  tokens/s;
- lossless inside the engine: the speculative text equals the plain text (or starts with it: the
  speculative tool may run past ``-n`` by up to ``N`` tokens; when plain stopped at the end of
  generation the texts must be equal). llama.cpp's tools print text, not ids, so the comparison is
  of the decoded texts. Where they part, the target scores both tokens in fp32 (``divergences``,
  :mod:`draftsmith.evals.near_ties`): llama.cpp's batched verify rounds unlike its one-token decode,
  so on AVX2 it picks the other of two near-tied tokens now and then (``near_ties_only``); a clear
  margin would be a real loss;
- the draftsmith runtime on the same export: a greedy chain of ``N`` drafted tokens per step
  (EAGLE-3: ``policy=chain, depth=N-1, fixed:N``, llama.cpp's shape; DFlash: one block, cut at ``N``
  by ``fixed:N``), its tau, acceptance, tokens/s, its own lossless check (speculative ids equal its
  AR ids) and whether its AR ids equal llama.cpp's plain ids (read from ``-v``'s evaluated-token
  log; compared as ids, since llama.cpp's text drops the EOS ours keeps; a cross-engine check: the
  two engines' numerics differ, so a late divergence between near-tied tokens is possible).
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draftsmith.bench import llamacpp, llamacpp_build
from draftsmith.bench import llamacpp_speculative as speculative_simple  # the tool this check runs
from draftsmith.bench.prompts import load_prompts
from draftsmith.bench.timing import time_interleaved
from draftsmith.common.errors import InputError
from draftsmith.evals.engine_agreement import (
    divergences,
    same_generated_ids,
    shared_prompt_ids,
    texts_lossless,
)
from draftsmith.export.format import read_config
from draftsmith.export.gguf import SPEC_TYPES
from draftsmith.runtime.decoding import metrics
from draftsmith.runtime.decoding.autoregressive import generate_ar

LABELS = {"eagle3": "EAGLE-3", "dflash": "DFlash"}


def run_speculative(
    target: Path,
    draft: Path,
    prompt: str,
    max_new_tokens: int,
    n_max: int,
    threads: int,
    spec_type: str,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """One greedy ``llama-speculative-simple --spec-type SPEC_TYPE`` run (``bench.llamacpp``'s argv
    with its ``draft-eagle3`` swapped for ``spec_type``), parsed by
    ``speculative_simple.parse_speculative``."""
    if spec_type == "draft-eagle3":
        return speculative_simple.run_speculative(
            target, draft, prompt, max_new_tokens, n_max, threads, timeout_s
        )
    ctx = max(512, len(prompt) + max_new_tokens + n_max + 64)
    argv = speculative_simple.speculative_command(
        target, draft, prompt, max_new_tokens, n_max, threads, ctx
    )
    argv[argv.index("draft-eagle3")] = spec_type
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{speculative_simple.SPECULATIVE} exited {proc.returncode}: {proc.stderr[-800:]}"
        )
    return speculative_simple.parse_speculative(proc.stdout, proc.stderr, prompt)


def llamacpp_speculative(
    target: Path,
    draft: Path,
    texts: Sequence[str],
    max_new_tokens: int,
    n_max: int,
    threads: int,
    spec_type: str = "draft-eagle3",
) -> dict[str, Any]:
    """Pooled counters and rates of ``llama-speculative-simple`` over ``texts``, with each prompt's
    text."""
    runs = [
        run_speculative(target, draft, t, max_new_tokens, n_max, threads, spec_type) for t in texts
    ]
    drafted, accepted = sum(r["n_drafted"] for r in runs), sum(r["n_accept"] for r in runs)
    predicted, decode_s = sum(r["n_predict"] for r in runs), sum(r["decode_s"] for r in runs)
    prompt_s = sum(r["prompt_s"] for r in runs)
    steps = predicted - accepted
    return {
        "spec_type": spec_type,
        "n_draft_max": n_max,
        "n_drafted": drafted,
        "n_accept": accepted,
        "n_predict": predicted,
        "acceptance": accepted / drafted if drafted else None,
        "tau": predicted / steps if steps else None,
        "decode_tokens_per_s": predicted / decode_s if decode_s > 0 else None,
        "tokens_per_s_incl_prompt": (
            predicted / (decode_s + prompt_s) if decode_s + prompt_s > 0 else None
        ),
        "texts": [r["text"] for r in runs],
        "per_prompt": [
            {k: r[k] for k in ("n_drafted", "n_accept", "n_predict", "decode_s")} for r in runs
        ],
    }


def runtime_side(runtime: Any, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    """The draftsmith runtime's AR and speculative decoding on ``prompts``, timed interleaved."""
    spec, results = runtime.speculative, []

    def speculative(prompt: list[int]) -> list[int]:
        res = spec.generate(prompt, max_new_tokens, eos_ids=runtime.eos_ids)
        results.append(res)
        return res.tokens

    timed = time_interleaved(
        {
            "ar": lambda p: generate_ar(runtime.model, p, max_new_tokens, eos_ids=runtime.eos_ids),
            "speculative": speculative,
        },
        prompts,
        {
            "ar": lambda: generate_ar(runtime.model, prompts[0], 4, eos_ids=runtime.eos_ids),
            "speculative": lambda: spec.generate(prompts[0], 4, eos_ids=runtime.eos_ids),
        },
    )
    results = results[-len(prompts) :]
    accepted = [a for r in results for a in r.accepted_per_step]
    drafted = sum(d for r in results for d in r.depths)
    ar, sp = timed["ar"], timed["speculative"]
    return {
        "tau": metrics.tau(accepted),
        "acceptance": sum(accepted) / drafted if drafted else None,
        "steps": sum(r.steps for r in results),
        "lossless": sp["outputs"] == ar["outputs"],
        "ar_tokens_per_s": ar["tokens_per_s"],
        "speculative_tokens_per_s": sp["tokens_per_s"],
        "ar_outputs": ar["outputs"],
        "dtype": str(runtime.model.dtype).removeprefix("torch."),
        "inference": runtime.inference,
    }


def default_n_max(config: dict[str, Any]) -> int:
    """Tokens drafted per step when none is asked for: DFlash's trained block (``block_size - 1``),
    else 4."""
    if config.get("method") == "dflash":
        return int(config["architecture"]["block_size"]) - 1
    return 4


def runtime_options(export_dir: str | Path, n_max: int) -> tuple[dict[str, Any], str]:
    """``(proposer_options, stop_policy)`` that make the runtime draft llama.cpp's shape: a chain of
    ``n_max`` tokens (the method's own chain options: EAGLE-3 ``policy=chain, depth=n_max-1``,
    DFlash ``depth=n_max``).
    """
    from draftsmith.runtime.drafting.registry import chain_options

    return chain_options(export_dir, n_max), f"fixed:{n_max}"


def engine_check(
    export_dir: str | Path,
    target_gguf: str | Path,
    draft_gguf: str | Path,
    prompts: str = "mtbench",
    num_prompts: int = 2,
    max_new_tokens: int = 32,
    n_max: int | None = None,
    threads: int = 2,
    dtype: str = "auto",
) -> dict[str, Any]:
    """The whole check (module docstring); raises :class:`llamacpp_build.LlamaCppMissing` without
    the build. ``n_max``: tokens drafted per step, default :func:`default_n_max`."""
    from draftsmith.runtime.serving import load_runtime

    method, n_max = _checked_method(export_dir, n_max)
    options, stop = runtime_options(export_dir, n_max)
    runtime = load_runtime(str(export_dir), None, dtype, proposer_options=options, stop_policy=stop)
    hf_ids = load_prompts(prompts, runtime.tokenizer, num_prompts)
    texts = llamacpp.prompt_texts(hf_ids, runtime.tokenizer)
    plain = llamacpp.llamacpp_row(
        target_gguf, hf_ids, max_new_tokens, threads, runtime.tokenizer, log_ids=True
    )
    ids, prompt_report = shared_prompt_ids(hf_ids, plain.pop("prompt_ids"))
    spec = llamacpp_speculative(
        Path(target_gguf),
        Path(draft_gguf),
        texts,
        max_new_tokens,
        n_max,
        threads,
        SPEC_TYPES[method],
    )
    verdict = _llamacpp_verdict(plain, spec, runtime, ids)
    ours = runtime_side(runtime, ids, max_new_tokens)  # the very ids llama.cpp decoded from
    ours["ids_equal_llamacpp_plain"] = same_generated_ids(ours.pop("ar_outputs"), plain, runtime)
    return {
        "engine": "llamacpp",
        "version": llamacpp_build.VERSION,
        "export": str(export_dir),
        "method": method,
        "target_gguf": str(target_gguf),
        "draft_gguf": str(draft_gguf),
        "prompts": prompts,
        "num_prompts": len(ids),
        "max_new_tokens": max_new_tokens,
        "threads": threads,
        "prompt_ids_match": prompt_report["same_in_both_engines"],
        "prompt_ids": prompt_report,
        "llamacpp": verdict,
        "runtime": ours,
    }


def _llamacpp_verdict(
    plain: dict[str, Any], spec: dict[str, Any], runtime: Any, ids: list[list[int]]
) -> dict[str, Any]:
    """llama.cpp's two rows and whether its speculative text is its plain one, per prompt (where it
    is not, the target's judgement of the two candidates: near-tie or clear margin)."""
    per_prompt = [
        texts_lossless(p, eos, s)
        for p, eos, s in zip(plain["texts"], plain["stopped_at_eos"], spec["texts"], strict=True)
    ]
    parted = divergences(runtime, ids, plain["texts"], spec["texts"], per_prompt)
    return {
        "lossless": all(per_prompt),
        "lossless_per_prompt": per_prompt,
        "near_ties_only": all(p is None or p["near_tie"] for p in parted),
        "divergences": parted,
        "plain": plain,
        "speculative": spec,
    }


def _checked_method(export_dir: str | Path, n_max: int | None) -> tuple[str, int]:
    """``(method, n_max)`` of an export llama.cpp can run, before any model loads: the build
    present, a method llama.cpp drafts with, ``n_max`` >= 1 (default :func:`default_n_max`)."""
    reason = llamacpp_build.missing_build_reason()
    if reason:
        raise llamacpp_build.LlamaCppMissing(reason)
    config = read_config(export_dir)
    if config["method"] not in SPEC_TYPES:
        raise InputError(
            f"llama.cpp runs {', '.join(LABELS.values())} drafters; {export_dir} is a "
            f"{config['method']!r} export"
        )
    n_max = default_n_max(config) if n_max is None else n_max
    if n_max < 1:
        raise InputError(f"--draft-n-max must be >= 1, got {n_max}")
    return config["method"], n_max
