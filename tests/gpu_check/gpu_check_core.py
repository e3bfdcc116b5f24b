"""``tests/gpu_check/gpu_check.py``'s shared parts: sizes (``Plan``), the state stages share
(``Context``), running one stage under a time limit with its failure caught, subprocesses into the
log, and the report (JSON + one markdown table).

Imported by name: ``tests/gpu_check/gpu_check.py`` puts its own folder on ``sys.path`` before
importing the ``gpu_check_*`` modules.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import signal
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.recipes import RECIPES

REPO = Path(__file__).resolve().parents[2]

# SmolLM2-135M-Instruct's shapes (its config.json); initializer_range is its own too.
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    initializer_range=0.041666666666666664,
)
# Four layers keep Triton's CPU interpreter quick; EAGLE-3 then needs explicit taps
# (TINY_TRAIN_EXTRA).
TINY_SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    initializer_range=0.05,
)

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] +"
    " '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n'"
    " }}{% endif %}"
)
SPECIALS = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "\n"]
WORDS = (
    "the a of to and in is it you that was for on are with as they be at one have this from or by"
    " word but what some we can out other were all there when up use your how said each which do"
    " their time if will way about many then them write would like so these long make thing see two"
    " has look more day could go come did number sound no most people my over know water than call"
    " first who may down side been now find hello world python code answer question please explain"
    " why fast slow tree draft token model"
).split()
PROMPTS = (
    "please explain why the tree is fast",
    "write python code for the answer",
    "what is the first word of the question",
    "how many people know the answer",
)
# What a tiny (4-layer) target needs per recipe, e.g. EAGLE-3's explicit taps (no three distinct
# defaults (2, L//2, L-3)): each recipe's tiny_overrides (its registration,
# recipes/<name>/__init__.py).
TINY_TRAIN_EXTRA = {r.name: list(r.tiny_overrides) for r in RECIPES.values() if r.tiny_overrides}
ACCEPTANCE_CAVEAT = (
    "random-weight target: parity and speed carry over to the real model, acceptance (tau) and "
    "speedups do not"
)
# Recipes that need an input beyond chat data (or make no drafter): not trained standalone by the
# GPU check (each recipe's needs_input).
NEEDS_INPUT = {r.name: r.needs_input for r in RECIPES.values() if r.needs_input}


@dataclass
class Plan:
    """Sizes and settings of one run (``--tiny`` shrinks all of them)."""

    device: str
    tiny: bool
    shape: dict
    train_steps: int
    max_length: int
    batch_size: int
    conversations: int
    new_tokens: int
    prompts: int
    save_dtype: str  # dtype the random target is written in
    target_dtype: str  # target.dtype while training
    speed_dtype: str  # serving dtype for timings
    trainer: list[str]
    speed_prompts: int  # prompts timed per kernel backend (Triton's CPU interpreter is slow)
    kernel_tokens: int  # greedy tokens per prompt in the kernel stage (parity and timings)
    repeats: int  # timed repeats of one forward

    @classmethod
    def make(cls, device: str, tiny: bool) -> Plan:
        """The plan for ``device`` (``cuda`` / ``cpu``), full-size or tiny."""
        cuda = device == "cuda"
        trainer = ["trainer=gpu"] if cuda else ["trainer=cpu", "trainer.precision=bf16-mixed"]
        return cls(
            device=device,
            tiny=tiny,
            shape=TINY_SHAPE if tiny else SMOLLM2_SHAPE,
            train_steps=2 if tiny else 20,
            max_length=48 if tiny else 256,
            batch_size=4 if tiny else 8,
            conversations=24 if tiny else 256,
            new_tokens=12 if tiny else 64,
            prompts=2 if tiny else 4,
            save_dtype="bf16" if cuda and not tiny else "fp32",
            target_dtype="bf16" if cuda else "fp32",
            speed_dtype="bf16" if cuda else "fp32",
            trainer=trainer,
            speed_prompts=1 if tiny else 4,
            kernel_tokens=4 if tiny else 64,
            repeats=20 if cuda else 1,
        )


@dataclass
class Context:
    """What stages share: the plan, folders, and results later stages build on."""

    plan: Plan
    out: Path
    work: Path
    log_path: Path
    fail_stages: set[str]
    # build the random SmolLM2-shaped target even if the converted one is cached
    random_target: bool = False
    target_note: str = ""
    target: Path | None = None
    data: Path | None = None
    prompts: list[list[int]] = field(default_factory=list)
    exports: dict[str, Path] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)
    recipes: list[str] = field(default_factory=list)  # empty: every standalone recipe

    def log(self, text: str) -> None:
        """Append to the run's log file (subprocess outputs and tracebacks land here too)."""
        with self.log_path.open("a") as handle:
            handle.write(text.rstrip("\n") + "\n")


class StageTimeout(Exception):
    """A stage ran past its time limit."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise StageTimeout in the main thread after ``seconds`` (SIGALRM; a no-op where signals are
    unavailable)."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise StageTimeout(f"ran past its {seconds:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_stage(name: str, fn: Callable[[Context], dict], ctx: Context, limit: float) -> dict:
    """Run one stage; whatever it raises becomes a ``fail`` record so the next stage still runs.

    ``fn`` returns ``{"ok": bool, "numbers": {...}, "note": str}``; ``ok`` defaults to True.
    """
    record: dict[str, Any] = {
        "stage": name,
        "status": "fail",
        "seconds": 0.0,
        "numbers": {},
        "note": "",
        "error": "",
    }
    start = time.perf_counter()
    ctx.log(f"===== stage {name} (limit {limit:.0f} s)")
    try:
        with time_limit(limit):
            if name in ctx.fail_stages:
                raise RuntimeError("injected failure (--fail-stage)")
            result = fn(ctx) or {}
        record["status"] = "pass" if result.get("ok", True) else "fail"
        record["numbers"] = result.get("numbers", {})
        record["note"] = result.get("note", "")
        record["error"] = result.get("error", "")
    except Exception as err:  # noqa: BLE001 - one stage's failure must not stop the others
        record["error"] = f"{type(err).__name__}: {err}"[:400]
        ctx.log(traceback.format_exc())
    record["seconds"] = round(time.perf_counter() - start, 2)
    ctx.log(f"===== {name}: {record['status']} in {record['seconds']} s {record['error']}")
    print(
        f"[gpu-check] {name}: {record['status'].upper()} ({record['seconds']} s) {record['error']}",
        flush=True,
    )
    free_memory(ctx)
    return record


def free_memory(ctx: Context) -> None:
    """Drop cached models between stages so GPU memory does not pile up."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort
        pass


def run_logged(ctx: Context, cmd: list[str], limit: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in the repo with output captured into the log; a timeout becomes StageTimeout."""
    ctx.log("$ " + " ".join(cmd))
    try:
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=limit,
            env={**os.environ, "HYDRA_FULL_ERROR": "1"},
        )
    except subprocess.TimeoutExpired as err:
        ctx.log(str(err.stdout or "")[-20000:] + str(err.stderr or "")[-20000:])
        raise StageTimeout(f"subprocess ran past its {limit:.0f} s limit") from err
    ctx.log(proc.stdout[-20000:] + "\n" + proc.stderr[-20000:])
    return proc


# ------------------------------------------------------------------------------------------- report


def fmt(value: Any) -> str:
    """Numbers compactly: floats to 4 significant digits (small diffs in scientific notation)."""
    if isinstance(value, float):
        return f"{value:.2e}" if value and abs(value) < 1e-2 else f"{value:.4g}"
    return str(value)


def markdown(report: dict) -> str:
    """The one table: every stage, pass/fail, seconds, numbers, note/error."""
    lines = [
        (
            f"**gpu-check** on {report['device_name']}"
            f" ({report['device']}{', tiny' if report['tiny'] else ''}):"
            f" {'ALL PASS' if report['ok'] else 'FAILED'} in {report['total_seconds']:.0f} s."
            f" Target: {report['target']}. Note: {ACCEPTANCE_CAVEAT}."
        ),
        "",
        "| stage | result | s | numbers | note |",
        "|---|---|---|---|---|",
    ]
    for r in report["stages"]:
        numbers = ", ".join(f"{k}={fmt(v)}" for k, v in r["numbers"].items()) or "-"
        note = (
            "; ".join(x for x in (r["error"], r["note"]) if x).replace("|", "/").replace("\n", " ")
            or "-"
        )
        lines.append(
            f"| {r['stage']} | {r['status'].upper()} | {r['seconds']:.1f} | {numbers} | {note} |"
        )
    return "\n".join(lines) + "\n"


def environment(device: str) -> dict:
    """Versions and the device name for the report header."""
    import torch

    name = (
        torch.cuda.get_device_name(0)
        if device == "cuda"
        else (platform.processor() or platform.machine())
    )
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - report, do not fail
        triton_version = None
    return {
        "device_name": name,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
    }


def write_report(
    ctx: Context, args: argparse.Namespace, env: dict, records: list[dict], seconds: float
) -> dict:
    """gpu_check.json and gpu_check.md in the output folder; returns the report."""
    report = {
        "device": args.device,
        "tiny": args.tiny,
        **env,
        "target": ctx.target_note,
        "caveat": ACCEPTANCE_CAVEAT,
        "ok": all(r["status"] == "pass" for r in records),
        "total_seconds": round(seconds, 1),
        "stages": records,
    }
    (ctx.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (ctx.out / "gpu_check.md").write_text(markdown(report))
    return report
