"""Cluster attempts: preemption checkpoints and resuming on a different number of devices.

Preemption (SLURM sends SIGTERM before the kill; ``--signal=USR1@<s>`` before the time limit):

* SIGUSR1 under SLURM: Lightning's ``SLURMEnvironment`` (auto-requeue) saves ``<run
  dir>/hpc_ckpt_<n>.ckpt`` and runs ``scontrol requeue <job>``; the requeued attempt resumes from
  the newest checkpoint.
* SIGTERM: Lightning sets ``trainer.received_sigterm`` and stops after the current batch with
  ``SIGTERMException``; :class:`ClusterCallback` then writes a regular checkpoint (``step<N>.ckpt``,
  ``last.ckpt`` linked to it). The bound is one training batch plus one checkpoint write, both
  logged. SLURM requeues a preempted job itself.

A resumed attempt with another world size keeps the global batch (``world x data.batch_size x
accumulation``, stored in ``checkpoints/global_batch.json``) by changing
``trainer.accumulate_grad_batches``, and rescales the interrupted epoch's position to the new
per-rank batch count, so the resumed run sees the same global batches.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, open_dict
from pytorch_lightning.utilities.exceptions import SIGTERMException

from draftsmith.common.errors import ConfigError
from draftsmith.distill.engine.checkpoints import CHECKPOINT_DIR, QuotaCheckpoint

log = logging.getLogger(__name__)

GLOBAL_BATCH_FILE = "global_batch.json"
_BATCH_KEY = (  # checkpoint entry: world, batch size and accumulation of the run that saved it
    "draftsmith_batch"
)


def planned_world_size(trainer_cfg: DictConfig) -> int:
    """Processes the trainer will run: ``devices x num_nodes`` (``-1``/``auto`` devices = every CUDA
    GPU, or 1 on CPU), or SLURM's task count when running under SLURM."""
    if os.environ.get("SLURM_NTASKS") and os.environ.get("SLURM_JOB_NAME") not in (
        "bash",
        "interactive",
    ):
        return int(os.environ["SLURM_NTASKS"])
    devices = trainer_cfg.devices
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if not isinstance(devices, int) or devices < 1:
        on_gpu = (
            str(trainer_cfg.accelerator) in ("gpu", "cuda", "auto") and torch.cuda.is_available()
        )
        devices = torch.cuda.device_count() if on_gpu else 1
    return devices * int(trainer_cfg.get("num_nodes", 1) or 1)


def read_global_batch(run_dir: str | Path) -> dict[str, int] | None:
    """The global-batch record of an earlier attempt in ``run_dir`` (None when this is the
    first)."""
    path = Path(run_dir) / CHECKPOINT_DIR / GLOBAL_BATCH_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        int(record["global_batch"]), int(record["world_size"]), int(record["batch_size"])
    except (
        OSError,
        ValueError,
        KeyError,
        TypeError,
    ) as err:  # damaged by hand or a copy: never a traceback
        log.warning(
            "%s is unreadable (%s): ignored; this attempt keeps its own batch settings", path, err
        )
        return None
    return record


def write_global_batch(
    run_dir: str | Path, world: int, batch_size: int, accumulate: int
) -> dict[str, int]:
    """Record ``world x batch_size x accumulate`` for later attempts (atomic write)."""
    record = {
        "world_size": world,
        "batch_size": batch_size,
        "accumulate_grad_batches": accumulate,
        "global_batch": world * batch_size * accumulate,
    }
    path = Path(run_dir) / CHECKPOINT_DIR / GLOBAL_BATCH_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)
    return record


def keep_global_batch(cfg: DictConfig, previous: dict[str, int] | None, world: int) -> int:
    """Set ``trainer.accumulate_grad_batches`` so that this attempt's global batch equals
    ``previous`` (an earlier attempt's record); returns the accumulation. A ConfigError when no
    whole accumulation can keep it.
    """
    batch, accumulate = int(cfg.data.batch_size), int(cfg.trainer.accumulate_grad_batches)
    if previous is None or previous["global_batch"] == world * batch * accumulate:
        return accumulate
    target = int(previous["global_batch"])
    if target % (world * batch):
        raise ConfigError(
            f"cannot keep the global batch {target} of the interrupted run (world"
            f" {previous['world_size']} x batch {previous['batch_size']} x accumulation"
            f" {previous['accumulate_grad_batches']}) on {world} devices with"
            f" data.batch_size={batch}: use a device count dividing {target // batch}, or"
            f" data.batch_size dividing {target // world}"
        )
    new = target // (world * batch)
    log.warning(
        "resuming on %d devices (was %d): trainer.accumulate_grad_batches %d -> %d keeps the global"
        " batch of %d sequences",
        world,
        previous["world_size"],
        accumulate,
        new,
        target,
    )
    with open_dict(cfg):
        cfg.trainer.accumulate_grad_batches = new
    return new


def rescale_loop_state(checkpoint: dict[str, Any], old_accumulate: int, new_accumulate: int) -> int:
    """Rewrite the saved epoch position for ``new_accumulate`` per-rank batches per optimizer step.

    The position is taken at the last optimizer step (the loader state ``batches_done_in_epoch`` is
    step-aligned), so a checkpoint written mid-accumulation (a SIGTERM between micro-batches) also
    resumes on a step boundary. Returns the per-rank batches done in the epoch after rescaling.
    """
    fit = checkpoint.get("loops", {}).get("fit_loop", {})
    loaders = fit.get("state_dict", {}).get("combined_loader") or []
    if not loaders or "batches_done_in_epoch" not in loaders[0]:
        return 0
    steps_in_epoch = int(loaders[0]["batches_done_in_epoch"]) // max(1, old_accumulate)
    done = steps_in_epoch * new_accumulate
    for state in loaders:
        state["batches_done_in_epoch"] = done
    progress = fit.get("epoch_loop.batch_progress", {})
    current, total = progress.get("current", {}), progress.get("total", {})
    # Shift every counter alike: a save in on_train_batch_end has completed = processed - 1
    # (Lightning completes the batch after the hook), a save on SIGTERM has completed = processed;
    # both keep their relation.
    shift = done - int(current.get("processed", done))
    for counters in (current, total):
        for key in ("ready", "started", "processed", "completed"):
            if key in counters:
                counters[key] = int(counters[key]) + shift
    return done


class ClusterCallback(pl.Callback):
    """Records the global batch, rescales a resumed epoch to a new accumulation, checkpoints on
    SIGTERM."""

    def __init__(self, run_dir: str | Path, checkpoint: QuotaCheckpoint, batch_size: int) -> None:
        self.run_dir = Path(run_dir)
        self.checkpoint = checkpoint
        self.batch_size = int(batch_size)

    def _record(self, trainer: pl.Trainer) -> dict[str, int]:
        return {
            "world_size": trainer.world_size,
            "batch_size": self.batch_size,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
        }

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            write_global_batch(
                self.run_dir, trainer.world_size, self.batch_size, trainer.accumulate_grad_batches
            )

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict
    ) -> None:
        checkpoint[_BATCH_KEY] = self._record(trainer)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict
    ) -> None:
        saved = checkpoint.get(_BATCH_KEY)
        if saved is None:
            return
        old, new = int(saved["accumulate_grad_batches"]), int(trainer.accumulate_grad_batches)
        done = rescale_loop_state(checkpoint, old, new)
        if old != new:
            log.warning(
                "checkpoint of %d x %d-step accumulation resumed as %d x %d: "
                "epoch position %d batches per rank",
                saved["world_size"],
                old,
                trainer.world_size,
                new,
                done,
            )

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        start = time.perf_counter()
        path = self.checkpoint.save_now(trainer)
        log.warning(
            "SIGTERM: checkpoint %s written at step %d in %.1fs; the next attempt resumes from it",
            path,
            trainer.global_step,
            time.perf_counter() - start,
        )
