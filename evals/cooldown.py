"""Cooldown branches of a learning curve: the value a point would read at the end of a finished run.

A constant-LR run read mid-run understates what a run of that length reaches once its learning rate
has decayed; branching a short linear decay to zero off the stable phase and reading the branch
predicts the finished run (Hagele et al., arXiv 2405.18392, "Scaling Laws and Compute-Optimal
Training Beyond Fixed Training Durations"). At a point of ``S`` steps the branch is the same
training resumed from the main run's step-``S`` checkpoint in a folder of its own, with
``optim.scheduler=wsd optim.decay_steps=L`` and ``trainer.max_steps=S+L`` (``L`` = ``--cooldown``
times ``S``): the learning rate falls linearly from the stable value to zero over ``L`` steps on the
batches the main run would see next, and the main run, its folder and its checkpoints are never
written. Folder (under the curve's)::

    branches/step<S>/checkpoints/step<S>.ckpt
                                   the seed: the main run's step-S checkpoint, copied (then renamed)
    branches/step<S>/...           the branch's own run folder (checkpoints, logs, export)
    points/step<S>/cooled/export/  the branch's export, evaluated like the point's own
    points/step<S>/cooled/training.json
                                   its steps, tokens and the branch's wall / CPU seconds

Every stage resumes: a killed branch restarts from its newest checkpoint (its seed at worst), a
copied export is kept; the seed and the branch's newest checkpoint are read before training and a
corrupt or partial one is refused in one line. Once the cooled export is kept, the branch's
checkpoints are deleted (they weigh as much as the main run's and nothing resumes from them).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from draftsmith.common.errors import DraftsmithError

BRANCHES_DIR, COOLED_DIR = "branches", "cooled"
CHECKPOINTS, LAST = "checkpoints", "last.ckpt"
BRANCH_KEYS = ("optim.scheduler", "optim.decay_steps", "run.resume")  # the branch sets these itself


class BranchError(DraftsmithError, ValueError):
    """A cooldown branch that cannot run: its seed or newest checkpoint is corrupt, or the main run
    moved past it."""


def decay_steps(steps: int, fraction: float) -> int:
    """Steps of the cooldown branched at ``steps``: ``fraction`` of the steps so far, at least
    one."""
    return max(1, round(float(fraction) * int(steps)))


def check_fraction(fraction: float, overrides: Sequence[str]) -> None:
    """Refuse a cooldown fraction outside [0, 1], and cooldowns on a main run whose LR is not
    constant (a branch of a decaying run would decay twice)."""
    if not 0.0 <= float(fraction) <= 1.0:
        raise BranchError(
            f"--cooldown {fraction}: the share of the steps so far the branch decays over must be"
            " in [0, 1] (0 turns branches off; 0.1-0.2 is usual)"
        )
    schedule = next(
        (
            o.split("=", 1)[1]
            for o in overrides
            if o.lstrip("+").split("=", 1)[0] == "optim.scheduler"
        ),
        "constant",
    )
    if float(fraction) > 0 and schedule != "constant":
        raise BranchError(
            "--cooldown branches a constant-LR run, and this curve trains with optim.scheduler="
            f"{schedule}: drop that override, or pass --cooldown 0"
        )


def branch_overrides(overrides: Sequence[str], decay: int) -> list[str]:
    """The main run's overrides with the branch's schedule: warmup-stable-decay, decaying over the
    last ``decay``. ``run.resume=changed``: the branch resumes the main run's checkpoint with that
    schedule on purpose (a resume that changes an ``optim`` key is refused otherwise,
    :mod:`draftsmith.distill.engine.resume_check`).
    """
    kept = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in BRANCH_KEYS]
    return [*kept, "optim.scheduler=wsd", f"optim.decay_steps={decay}", "run.resume=changed"]


def checkpoint_step(path: Path) -> int:
    """The optimizer step a checkpoint file holds; :class:`BranchError` (one line) for a file torch
    cannot read (a partial copy, a truncated save, something else)."""
    import torch

    try:
        ckpt = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
        return int(ckpt["global_step"])
    except Exception as err:  # noqa: BLE001 - torch raises several types for damaged files
        raise BranchError(
            f"{path} is corrupt or partial ({type(err).__name__}: {str(err)[:120]}); delete "
            f"{path.parent.parent} and re-run the same command to branch again"
        ) from None


def seed_branch(main_run: Path, branch: Path, steps: int) -> None:
    """Copy the main run's step-``steps`` checkpoint into ``branch`` (temporary file, then renamed)
    and point the branch's ``last.ckpt`` at it; nothing of the main run is written. A branch already
    seeded is checked, not copied.
    """
    folder = branch / CHECKPOINTS
    seed = folder / f"step{steps}.ckpt"
    if seed.is_file() or (folder / LAST).exists():
        newest = (folder / LAST).resolve() if (folder / LAST).exists() else seed
        checkpoint_step(
            newest
        )  # a damaged newest checkpoint is refused before training starts on it
        return
    source = main_run / CHECKPOINTS / f"step{steps}.ckpt"
    if not source.is_file():
        raise BranchError(
            f"cannot branch at step {steps}: the main run keeps no step-{steps} checkpoint "
            f"({source}); the point is reported without a cooled value"
        )
    if checkpoint_step(source) != steps:
        raise BranchError(
            f"{source} does not hold step {steps}; the main run's folder was changed by hand"
        )
    folder.mkdir(parents=True, exist_ok=True)
    tmp = seed.with_name(f".{seed.name}.tmp-{os.getpid()}")
    shutil.copyfile(source, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    batch = main_run / CHECKPOINTS / "global_batch.json"  # the global batch the branch must keep
    if batch.is_file():
        shutil.copyfile(batch, folder / batch.name)
    os.replace(tmp, seed)
    link = folder / f".{LAST}.tmp-{os.getpid()}"
    link.unlink(missing_ok=True)
    os.symlink(seed.name, link)
    os.replace(link, folder / LAST)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON record the curve wrote (atomically), or None when absent; a damaged one is refused in
    one line."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise BranchError(
            f"{path} is corrupt ({err}); delete it and re-run the same command to redo that step"
        ) from None


def run_branch(
    curve_out: Path,
    overrides: Sequence[str],
    steps: int,
    fraction: float,
    runner: Callable[[list[str]], int],
    train_to: Callable[..., tuple[float, float]],
    copy_export: Callable[[Path, Path], None],
    tokens_seen: Callable[[Path], int | None],
    write_json: Callable[[Path, dict], None],
) -> tuple[Path, dict[str, Any]]:
    """Branch, train and export the cooldown of the point at ``steps`` (or take what an earlier run
    kept): (cooled export folder, its training record)."""
    from draftsmith.evals.curve_folder import POINTS_DIR, RUN_DIR

    point = curve_out / POINTS_DIR / f"step{steps}" / COOLED_DIR
    export, meta_path = point / "export", point / "training.json"
    meta = read_json(meta_path)
    if meta is not None and (export / "config.json").is_file():
        return export, meta
    decay = decay_steps(steps, fraction)
    branch = curve_out / BRANCHES_DIR / f"step{steps}"
    seed_branch(curve_out / RUN_DIR, branch, steps)
    seconds, cpu = train_to(branch, branch_overrides(overrides, decay), steps + decay, runner)
    point.mkdir(parents=True, exist_ok=True)
    copy_export(branch / "export", export)
    meta = {
        "branched_at": steps,
        "decay_steps": decay,
        "steps": steps + decay,
        "segment_seconds": seconds,
        "segment_cpu_seconds": cpu,
        "tokens": tokens_seen(branch),
    }
    write_json(meta_path, meta)
    shutil.rmtree(
        branch / CHECKPOINTS, ignore_errors=True
    )  # nothing resumes from them once the export is kept
    return export, meta


def cooled_record(
    meta: dict[str, Any], evaluation: dict[str, Any], export: Path, curve_out: Path
) -> dict[str, Any]:
    """The point's ``cooled`` block: the branch's steps, tokens, CPU seconds and evaluation
    (cumulative CPU-hours are settled by the report: the main run's at the branch point plus the
    branch's own)."""
    return {
        "branched_at": meta["branched_at"],
        "decay_steps": meta["decay_steps"],
        "steps": meta["steps"],
        "tokens": meta["tokens"],
        "branch_seconds": meta["segment_seconds"],
        "branch_cpu_seconds": meta["segment_cpu_seconds"],
        "export": str(export.relative_to(curve_out)),
        "eval": evaluation,
    }
