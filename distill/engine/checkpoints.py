"""Checkpoints that fit a cluster's disk quota: the newest ``run.keep_checkpoints`` step files,
``last.ckpt`` a link to the newest, the size of each in the log, every write atomic.

A full disk (or quota) during a save is a clean stop: the save's own temporary file is removed,
``last.ckpt`` keeps naming the last complete checkpoint, and :class:`CheckpointDiskFull` says in one
line which file, how much space it needs and how much is free; a re-run after space is freed resumes
from ``last.ckpt``. Temporaries an earlier process left (``.step40.ckpt.tmp-<pid>``, killed or
stopped by a full disk) are removed when the next run starts, with a warning.

``last.ckpt`` is a relative symlink replaced atomically (a new link renamed over the old one). Where
the file system refuses symlinks, a small pointer file ``checkpoints/last`` holds the newest
checkpoint's file name instead of a second full copy; :mod:`.resume_point` reads either, and
picks the checkpoint a resumed run starts from.

Retention counts across attempts: a resumed run tracks the step files already in the folder
(:meth:`QuotaCheckpoint.on_train_start`), so a moved run folder or a changed
``run.checkpoint_every`` keeps the newest ``run.keep_checkpoints`` as promised.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from draftsmith.common.atomic_folder import (
    disk_full_message,
    human_bytes,
    is_disk_full,
    remove_stale_temporaries,
)
from draftsmith.common.errors import ConfigError, DraftsmithError
from draftsmith.distill.engine.interrupts import CheckpointInterrupted

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
LAST_POINTER = "last"  # text file naming the newest checkpoint, where symlinks are refused
_STEP_FILE = re.compile(r"step(\d+)\.ckpt$")


class CheckpointDiskFull(DraftsmithError, OSError):
    """The disk filled while a checkpoint was written: its temporary was removed, ``last.ckpt``
    still names the last complete checkpoint (a re-run resumes there)."""

    def __str__(self) -> str:  # the one line alone, without OSError's "[Errno 28]" prefix
        return str(self.strerror)


def temporary_of(path: str | Path, pid: int | None = None) -> Path:
    """The temporary a checkpoint save writes before its rename (``AtomicCheckpointIO``):
    ``.<name>.tmp-<pid>``."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid() if pid is None else pid}")


def disk_full_stop(filepath: str | Path, err: BaseException) -> CheckpointDiskFull:
    """The one-line stop for a checkpoint save that filled the disk: the file, the space it needs
    (about the size of the newest complete checkpoint beside it, else more than it had written), the
    space free, where a re-run resumes.
    """
    filepath = Path(filepath)
    tmp = temporary_of(filepath)
    written = tmp.stat().st_size if tmp.exists() else 0
    done = [p for p in filepath.parent.glob("step*.ckpt") if p.name != filepath.name]
    previous = max(done, key=step_of) if done else None
    kept = (
        f"last.ckpt still names {previous.name}, where a re-run resumes"
        if previous is not None
        else "no checkpoint of this run was complete yet"
    )
    needed = checkpoint_bytes(previous) if previous is not None else None
    return CheckpointDiskFull(errno.ENOSPC, disk_full_message(filepath, needed, written, kept))


def checkpoint_bytes(path: str | Path) -> int:
    """Bytes of a checkpoint file, or of a checkpoint folder (DeepSpeed / FSDP sharded) summed over
    its files."""
    path = Path(path)
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else 0


def link_last(target: str | Path, link: str | Path) -> str:
    """Point ``link`` (``last.ckpt``) at ``target`` atomically; returns ``symlink`` or ``pointer``.

    A new relative symlink is made beside the link and renamed over it, so ``last.ckpt`` always
    names a complete checkpoint. Where symlinks fail (some network / Windows file systems),
    ``<dir>/last`` gets the file name instead.
    """
    target, link = Path(target), Path(link)
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    try:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(os.path.relpath(target, link.parent), tmp)
        os.replace(tmp, link)
        return "symlink"
    except OSError:
        pointer = link.parent / LAST_POINTER
        pointer_tmp = pointer.with_name(f".{pointer.name}.tmp-{os.getpid()}")
        pointer_tmp.write_text(os.path.relpath(target, link.parent) + "\n")
        os.replace(pointer_tmp, pointer)
        return "pointer"


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint file, or a checkpoint folder (DeepSpeed and sharded FSDP checkpoints are
    folders)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def step_of(path: str | Path) -> int:
    """The step number in a ``step<N>.ckpt`` name (-1 for other names)."""
    match = _STEP_FILE.search(Path(path).name)
    return int(match.group(1)) if match else -1


def check_run_folder(run_dir: str | Path) -> None:
    """Refuse, before anything loads, a run folder that is a file (or whose ``checkpoints``/``logs``
    is one), or that cannot be written (a read-only file system, no permission): training would stop
    at its first write otherwise.
    """
    run_dir = Path(run_dir).expanduser()
    for path in (run_dir, run_dir / CHECKPOINT_DIR, run_dir / "logs"):
        if path.exists() and not path.is_dir():
            raise ConfigError(
                f"the run folder's {path} is a file, not a folder: nothing was trained or written; "
                "choose another hydra.run.dir"
            )
    ancestor = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not ancestor.is_dir():
        raise ConfigError(
            f"the run folder {run_dir} cannot be made: {ancestor} is a file; choose another "
            "hydra.run.dir"
        )
    for folder in (ancestor, run_dir / CHECKPOINT_DIR):
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
            why = (
                "is on a read-only file system"
                if read_only
                else "cannot be written (permission denied)"
            )
            raise ConfigError(
                f"the run folder {run_dir}: {folder} {why}, and a run writes its checkpoints and"
                " logs there: nothing was trained; choose a hydra.run.dir you can write to"
            )


def drop_stale_requeue_checkpoints(run_dir: str | Path, newer: Path) -> list[Path]:
    """Delete SLURM requeue checkpoints (``hpc_ckpt_<n>.ckpt``) older than ``newer``: once a regular
    checkpoint supersedes them they only eat quota. Returns the deleted paths."""
    if not newer.exists():
        return []
    stale = [
        p
        for p in Path(run_dir).glob("hpc_ckpt_*.ckpt")
        if p.stat().st_mtime <= newer.stat().st_mtime
    ]
    for path in stale:
        remove_checkpoint(path)
    return stale


class QuotaCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint keeping the newest ``keep`` step checkpoints (top-k by step),
    ``last.ckpt`` an atomic link to the newest, each save's size and duration logged. ``save_now``
    saves outside the schedule (on preemption)."""

    def __init__(self, dirpath: str | Path, every_n_train_steps: int, keep: int = 2) -> None:
        if int(keep) < 1:
            raise ConfigError(f"run.keep_checkpoints must be >= 1, got {keep}")
        super().__init__(
            dirpath=str(dirpath),
            filename="step{step}",
            auto_insert_metric_name=False,
            every_n_train_steps=every_n_train_steps,
            save_last="link",
            save_top_k=int(keep),
            monitor="step",
            mode="max",
            enable_version_counter=False,
        )
        self.link_kind = ""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        # what an earlier attempt's failed save left
        if trainer.is_global_zero and Path(self.dirpath).is_dir():
            remove_stale_temporaries(Path(self.dirpath))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if trainer.ckpt_path is not None and trainer.is_global_zero:
            self.track_existing(trainer.global_step)

    def track_existing(self, step: int) -> None:
        """Count the step files already in the folder (up to ``step``, the one resumed) as the kept
        ones: Lightning restores its list only from a checkpoint written in this very folder with
        this ``checkpoint_every``, so a moved run folder or a changed schedule used to drop every
        earlier file at the first save."""
        files = sorted(
            (p for p in Path(self.dirpath).glob("step*.ckpt") if 0 <= step_of(p) <= step),
            key=step_of,
        )
        kept = files[-self.save_top_k :]
        self.best_k_models = {
            os.path.join(self.dirpath, p.name): torch.tensor(float(step_of(p))) for p in kept
        }
        if not kept:
            return
        newest, oldest = (os.path.join(self.dirpath, p.name) for p in (kept[-1], kept[0]))
        self.best_model_path, self.best_model_score = newest, self.best_k_models[newest]
        if len(kept) == self.save_top_k:
            self.kth_best_model_path, self.kth_value = oldest, self.best_k_models[oldest]
        else:  # fewer than `keep`: the next saves add to them
            self.kth_best_model_path = ""

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        start = time.perf_counter()
        try:
            super()._save_checkpoint(trainer, filepath)
        # Ctrl-C during the write: the finished file becomes last.ckpt
        except CheckpointInterrupted as stop:
            if stop.saved is not None and trainer.is_global_zero:
                self.link_kind = link_last(filepath, Path(self.dirpath) / LAST_CHECKPOINT)
            raise
        except BaseException as err:
            stop = disk_full_stop(filepath, err) if is_disk_full(err) else None
            temporary_of(filepath).unlink(
                missing_ok=True
            )  # a partial checkpoint is never resumed: never keep it
            if stop is not None:
                raise stop from err
            raise
        if trainer.is_global_zero:
            log.info(
                "checkpoint %s: %s in %.1fs (keeping the newest %d)",
                Path(filepath).name,
                human_bytes(checkpoint_bytes(filepath)),
                time.perf_counter() - start,
                self.save_top_k,
            )
            drop_stale_requeue_checkpoints(trainer.default_root_dir, Path(filepath))
            self._drop_untracked(filepath)

    def _drop_untracked(self, newest: str) -> None:
        """Delete step files older than every kept one: Lightning never deletes the checkpoint a run
        resumed from, which would otherwise stay behind after each attempt."""
        kept = {os.path.abspath(p) for p in self.best_k_models} | {os.path.abspath(newest)}
        oldest_kept = min((step_of(p) for p in kept), default=-1)
        for path in Path(self.dirpath).glob("step*.ckpt"):
            if os.path.abspath(path) not in kept and 0 <= step_of(path) < oldest_kept:
                remove_checkpoint(path)

    def _link_checkpoint(self, trainer: pl.Trainer, filepath: str, linkpath: str) -> None:  # type: ignore[override]
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            self.link_kind = link_last(filepath, linkpath)
        trainer.strategy.barrier()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The final state is always on disk (max_steps need not be a multiple of checkpoint_every):
        # a later `trainer.max_steps=<more>` continues from it.
        self.save_now(trainer)

    def save_now(self, trainer: pl.Trainer) -> str | None:
        """Save a checkpoint of the current step now (top-k bookkeeping and ``last`` link included);
        returns its path, or None when this step is already saved."""
        if self._last_global_step_saved == trainer.global_step:
            return self._last_checkpoint_saved or None
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
        return self._last_checkpoint_saved
