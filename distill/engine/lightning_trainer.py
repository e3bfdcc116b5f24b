"""The Lightning Trainer of a run, built from ``cfg.trainer``: the device and precision it trains
in, its gradient clipping (left to the module under FSDP), the SLURM environment and node count,
and the standard callbacks (atomic checkpoints kept to a quota, the cluster's requeue handling, the
step progress bar, Ctrl-C handling).
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from omegaconf import DictConfig

from draftsmith.distill.cluster.attempts import ClusterCallback
from draftsmith.distill.cluster.strategies import (
    build_precision,
    build_strategy,
    check_devices,
    resolve_precision,
    strategy_family,
    trainer_device,
)
from draftsmith.distill.engine.checkpoints import CHECKPOINT_DIR, QuotaCheckpoint
from draftsmith.distill.engine.interrupts import AtomicCheckpointIO, InterruptWatch
from draftsmith.distill.engine.progress import StepProgressBar
from draftsmith.distill.engine.run_logs import build_loggers

log = logging.getLogger(__name__)


def run_device(trainer_cfg: DictConfig) -> str:
    """The device type the trainer will place the target on (``cuda`` or ``cpu``), for
    ``target.dtype=auto``."""
    return trainer_device(trainer_cfg)


def apply_precision(cfg: DictConfig) -> str:
    """Resolve ``trainer.precision=auto`` for this machine in ``cfg`` (so the resolved config
    records it), log the choice and why, and return it."""
    precision, why = resolve_precision(cfg.trainer)
    log.info("trainer precision: %s", why)
    cfg.trainer.precision = precision
    return precision


def grad_clipping(optim_cfg: DictConfig, trainer_cfg: DictConfig | None = None) -> dict[str, Any]:
    """Lightning's ``gradient_clip_val`` / ``gradient_clip_algorithm`` from ``optim.grad_clip`` (0 =
    off) and ``optim.grad_clip_algorithm`` (``norm``: rescale the global gradient norm; ``value``:
    clamp each element). Under FSDP, norm clipping is left to the module
    (:func:`sharded_clip_norm`): Lightning's FSDP precision refuses it."""
    value = float(optim_cfg.grad_clip or 0.0)
    if not value or (trainer_cfg is not None and sharded_clip_norm(optim_cfg, trainer_cfg)):
        return {"gradient_clip_val": None, "gradient_clip_algorithm": None}
    return {
        "gradient_clip_val": value,
        "gradient_clip_algorithm": str(optim_cfg.grad_clip_algorithm),
    }


def sharded_clip_norm(optim_cfg: DictConfig, trainer_cfg: DictConfig) -> float | None:
    """The global-norm clip the module applies itself under FSDP (FSDP's ``clip_grad_norm_`` reduces
    the norm over the shards), or None where Lightning's own clipping runs."""
    value = float(optim_cfg.grad_clip or 0.0)
    norm = str(optim_cfg.grad_clip_algorithm) == "norm"
    return value if value and norm and strategy_family(trainer_cfg) == "fsdp" else None


def slurm_environment(cfg: DictConfig) -> list:
    """Lightning's SLURM environment with auto-requeue on SIGUSR1 when running under SLURM
    (``run.requeue``)."""
    from lightning_fabric.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect():
        return []
    return [SLURMEnvironment(auto_requeue=bool(cfg.run.requeue), requeue_signal=signal.SIGUSR1)]


def node_count(trainer_cfg: DictConfig) -> int:
    """``trainer.num_nodes``, or SLURM's node count (``SLURM_NNODES``) when a SLURM job has more
    nodes than that."""
    nodes = int(trainer_cfg.get("num_nodes", 1) or 1)
    slurm = int(os.environ.get("SLURM_NNODES", "0") or 0)
    if slurm > nodes:
        log.warning(
            "SLURM job has %d nodes and trainer.num_nodes=%d: training on %d nodes",
            slurm,
            nodes,
            slurm,
        )
        return slurm
    return nodes


def build_trainer(
    cfg: DictConfig,
    run_dir: Path,
    callbacks: list | None = None,
    drafter: Any = None,
    run_name: str | None = None,
) -> pl.Trainer:
    """A Lightning Trainer from ``cfg.trainer``: the preset's strategy object
    (:mod:`draftsmith.distill.cluster.strategies`, ``drafter`` for FSDP's wrap policy), atomic
    checkpoints every ``run.checkpoint_every`` steps keeping the newest ``run.keep_checkpoints``
    (:class:`~draftsmith.distill.engine.checkpoints.QuotaCheckpoint`), a checkpoint on SIGTERM and
    SLURM requeue (:mod:`draftsmith.distill.cluster.attempts`), and a step-based progress bar."""
    t = cfg.trainer
    check_devices(t)
    run_dir = Path(run_dir)
    checkpoint = QuotaCheckpoint(
        run_dir / CHECKPOINT_DIR,
        every_n_train_steps=int(cfg.run.checkpoint_every),
        keep=int(cfg.run.keep_checkpoints),
    )
    precision = build_precision(t)
    resolved = resolve_precision(t)[0]
    plugins = [
        AtomicCheckpointIO(),
        *slurm_environment(cfg),
        *([precision] if precision is not None else []),
    ]
    val_every = int(cfg.run.val_every)
    return pl.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=node_count(t),
        strategy=build_strategy(t, drafter),
        precision=None if precision is not None else resolved,
        max_steps=int(t.max_steps),
        max_time=t.max_time or None,
        accumulate_grad_batches=int(t.accumulate_grad_batches),
        **grad_clipping(cfg.optim, t),
        log_every_n_steps=int(t.log_every_n_steps),
        val_check_interval=val_every if val_every > 0 else None,
        check_val_every_n_epoch=None if val_every else 1,
        limit_val_batches=int(cfg.run.final_eval_batches),
        num_sanity_val_steps=0,
        logger=build_loggers(cfg, run_dir, run_name),
        callbacks=[
            checkpoint,
            ClusterCallback(run_dir, checkpoint, int(cfg.data.batch_size)),
            StepProgressBar(),
            InterruptWatch(),
            *(callbacks or []),
        ],
        plugins=plugins,
        default_root_dir=str(run_dir),
        enable_model_summary=False,
        use_distributed_sampler=True,
    )
