"""The cached llama.cpp build that ``make llamacpp`` installs (``scripts/build_llamacpp.sh``):
where it lives, whether it is complete (and why not), and the target converted once to a BF16 GGUF
with its converter.

The build is llama.cpp as vendored by the PyPI source distribution ``llama-cpp-python==0.3.36``,
built once into ``$DRAFTSMITH_CACHE/llamacpp-0.3.36`` (default ``~/.cache/draftsmith``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from draftsmith import assets
from draftsmith.common.errors import DraftsmithError

VERSION = "0.3.36"
# 353 s on a 2-core AMD EPYC (Zen 4) VM at low priority beside other work; the script records each
# build's time
BUILD_MINUTES_ESTIMATE = 6
COMPLETION = "llama-completion"


class LlamaCppMissing(DraftsmithError, RuntimeError):
    """The cached llama.cpp build (or a weight file it needs) is not there; the message says what to
    run."""


def llamacpp_dir() -> Path:
    """Where ``make llamacpp`` installs llama.cpp: ``bin/``, the converter, ``build_seconds``,
    ``gguf/``."""
    return assets.cache_dir() / f"llamacpp-{VERSION}"


def missing_build_reason(root: Path | None = None) -> str | None:
    """``None`` when the cached build is complete, else why not and what to run (a failed build's
    kept reason)."""
    root = root or llamacpp_dir()
    if (root / ".done").is_file() and (root / "bin" / COMPLETION).is_file():
        return None
    failed = root.parent / f"{root.name}.failed"
    if failed.is_file():
        tail = " | ".join(
            line.strip() for line in failed.read_text().splitlines()[-3:] if line.strip()
        )
        return (
            f"llama.cpp build failed ({tail}); full log {root.parent / f'{root.name}.log'}; fix the"
            " cause and retry: make llamacpp"
        )
    return f"not built: run `make llamacpp` (one-time, ~{BUILD_MINUTES_ESTIMATE} min)"


def bf16_gguf(target_dir: str | Path | None = None, python: str = sys.executable) -> Path:
    """The target converted once to a BF16 GGUF with the cached ``convert_hf_to_gguf.py`` (kept in
    ``gguf/``), run on ``python`` (torch, transformers, numpy) with the build's ``pydeps/``
    (sentencepiece) first on its path.
    """
    root = llamacpp_dir()
    reason = missing_build_reason(root)
    if reason:
        raise LlamaCppMissing(reason)
    folder = Path(target_dir) if target_dir else assets.default_target_dir()
    out = root / "gguf" / f"{folder.name}-bf16.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(
        f"{out.name}.{os.getpid()}.partial"
    )  # two benches converting at once never collide
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(root / "pydeps"), os.environ.get("PYTHONPATH")])
        ),
    }
    proc = subprocess.run(
        [
            python,
            str(root / "convert_hf_to_gguf.py"),
            str(folder),
            "--outtype",
            "bf16",
            "--outfile",
            str(partial),
        ],
        capture_output=True,
        text=True,
        errors="replace",
        env=env,
    )
    if proc.returncode != 0 or not partial.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {folder}: {proc.stderr[-800:]}")
    partial.replace(out)
    return out


def greedy_run_flags(prompt: str, max_new_tokens: int, threads: int, ctx: int) -> list[str]:
    """The flags every greedy llama.cpp run here shares (completion and speculative tools): the
    raw prompt, the token budget, the threads, the context, greedy sampling with a fixed seed."""
    return [
        "-p",
        prompt,
        "-n",
        str(max_new_tokens),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        str(ctx),
        "--temp",
        "0",
        "--top-k",
        "1",
        "--seed",
        "0",
    ]
