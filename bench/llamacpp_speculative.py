"""llama.cpp's speculative decoding tool (``llama-speculative-simple --spec-type draft-eagle3``) on
one prompt: its argv, its run, and the counters, times and text parsed from its output
(``draftsmith engine-check`` and ``bench export --engine-parity`` read them).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

from draftsmith.bench.llamacpp_build import greedy_run_flags, llamacpp_dir

SPECULATIVE = "llama-speculative-simple"


_SPEC_COUNTS = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)")


_SPEC_TIMES = re.compile(r"\b(encoded|decoded)\s+(\d+) tokens in\s+([\d.]+) seconds")


def speculative_command(
    target: Path, draft: Path, prompt: str, max_new_tokens: int, n_max: int, threads: int, ctx: int
) -> list[str]:
    """The ``llama-speculative-simple`` argv of one greedy EAGLE-3 run (raw prompt taken verbatim,
    as :func:`completion_command`; ``--spec-draft-n-max``: tokens drafted per step)."""
    return [
        str(llamacpp_dir() / "bin" / SPECULATIVE),
        "-m",
        str(target),
        "-md",
        str(draft),
        "--spec-type",
        "draft-eagle3",
        "--spec-draft-n-max",
        str(n_max),
        *greedy_run_flags(prompt, max_new_tokens, threads, ctx),
        "--no-escape",
    ]


def parse_speculative(stdout: str, stderr: str, prompt: str) -> dict[str, Any]:
    """Counters, times and generated text of a ``llama-speculative-simple`` run. Its stdout is
    "\\n\\n", the prompt's pieces, the new tokens' pieces (the end-of-generation token not printed),
    "\\n\\n" twice; its log has ``n_drafted``, ``n_accept``, ``n_predict`` (tokens generated: sum
    over verify steps of accepted + 1) and the encode/decode times. Raises ``ValueError`` when a
    line is missing."""
    counts = {k: int(v) for k, v in _SPEC_COUNTS.findall(stderr)}
    times = {k: (int(n), float(sec)) for k, n, sec in _SPEC_TIMES.findall(stderr)}
    if len(counts) < 4 or len(times) < 2:
        raise ValueError(
            "no n_drafted / n_accept / decoded lines in llama-speculative-simple's log: "
            + stderr[-600:]
        )
    text = stdout.removeprefix("\n\n")
    text = text[len(prompt) :] if text.startswith(prompt) else text
    text = text.removesuffix("\n\n\n\n")  # two "\\n\\n": after the text, and at exit
    return {
        **counts,
        "prompt_tokens": times["encoded"][0],
        "prompt_s": times["encoded"][1],
        "decode_s": times["decoded"][1],
        "text": text,
    }


def run_speculative(
    target: Path,
    draft: Path,
    prompt: str,
    max_new_tokens: int,
    n_max: int,
    threads: int = 2,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """One greedy ``llama-speculative-simple --spec-type draft-eagle3`` run
    (:func:`parse_speculative`'s dict)."""
    ctx = max(512, len(prompt) + max_new_tokens + n_max + 64)
    proc = subprocess.run(
        speculative_command(target, draft, prompt, max_new_tokens, n_max, threads, ctx),
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{SPECULATIVE} exited {proc.returncode}: {proc.stderr[-800:]}")
    return parse_speculative(proc.stdout, proc.stderr, prompt)
