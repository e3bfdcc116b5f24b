"""The curve's training: the overrides every segment runs with, ``draftsmith train`` segments in
child processes billed by their own CPU time, the tokens a run has seen, and an export copied so it
exists only complete."""

from __future__ import annotations

import csv
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from draftsmith.evals.curve_folder import CurveError

# The curve evaluates each point itself: training's own end-of-run validation shrinks to one batch,
# its served-tau probe is off, and the learning rate stays constant after warm-up.
DEFAULT_OVERRIDES = {
    "optim.scheduler": "constant",
    "validation.served_tau.every": "0",
    "run.final_eval_batches": "1",
}
PROTECTED = (
    "hydra.run.dir",
    "trainer.max_steps",
    "trainer.max_time",
)  # the curve sets these itself


def training_overrides(user: Sequence[str]) -> list[str]:
    """The user's overrides plus the curve's defaults for keys the user left alone; refuses keys the
    curve sets."""
    keys = {o.lstrip("+~").split("=", 1)[0] for o in user}
    clash = sorted(keys & set(PROTECTED))
    if clash:
        raise CurveError(
            f"{', '.join(clash)} is set by the curve itself (--out, --steps); leave it out"
        )
    if not any(k == "recipe" for k in keys):
        raise CurveError("name a recipe, e.g. `draftsmith curve --out DIR recipe=eagle3`")
    return [*user, *(f"{k}={v}" for k, v in DEFAULT_OVERRIDES.items() if k not in keys)]


def tokens_seen(run_dir: Path) -> int | None:
    """Non-padding tokens the run has trained on: its export's exact count (``training.tokens``),
    else the largest ``train/tokens`` in its CSV logs (logged every few steps, so a short segment
    may log none)."""
    try:
        exact = (
            json.loads((run_dir / "export" / "config.json").read_text())
            .get("training", {})
            .get("tokens")
        )
    except (OSError, ValueError, AttributeError):
        exact = None
    if isinstance(exact, int) and exact > 0:
        return exact
    best = None
    for path in run_dir.rglob("metrics.csv"):
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                value = row.get("train/tokens")
                if value:
                    best = max(best or 0, int(float(value)))
    return best


def copy_export(source: Path, dest: Path) -> None:
    """Copy an export folder to ``dest`` beside-then-rename, so ``dest`` exists only complete."""
    if not (source / "config.json").is_file():
        raise CurveError(f"training finished without an export in {source} (run.export=false?)")
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)


def children_cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process's finished children (the training
    segments)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def train_to(
    run_dir: Path,
    overrides: Sequence[str],
    steps: int,
    runner: Callable[[list[str]], int],
) -> tuple[float, float]:
    """Train (or resume) ``run_dir`` (the main run, or a cooldown branch) until ``steps``: (wall
    seconds, CPU seconds) it took. CPU seconds are what the training process itself used, so a
    segment that shared the machine is not billed for the others' time."""
    argv = [*overrides, f"hydra.run.dir={run_dir}", f"trainer.max_steps={steps}"]
    start, cpu = time.perf_counter(), children_cpu_seconds()
    code = runner(argv)
    if code != 0:
        raise CurveError(
            f"training segment to step {steps} failed (exit {code}); fix the error above and re-run"
            " the same `draftsmith curve` command: it resumes from the last checkpoint"
        )
    return time.perf_counter() - start, children_cpu_seconds() - cpu


def subprocess_train(argv: list[str]) -> int:
    """Run ``draftsmith train ARGV`` in a child process (a fresh Hydra app per segment)."""
    return subprocess.call([sys.executable, "-m", "draftsmith.cli", "train", *argv])
