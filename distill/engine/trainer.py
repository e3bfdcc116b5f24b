"""Run a training job from a composed config: target, data, objective, Lightning Trainer,
checkpoints, export."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.common.errors import ConfigError
from draftsmith.distill.cluster.attempts import (
    ClusterCallback,
    keep_global_batch,
    planned_world_size,
    read_global_batch,
)
from draftsmith.distill.cluster.strategies import (
    apply_activation_checkpointing,
    build_precision,
    build_strategy,
    check_devices,
    resolve_precision,
    strategy_family,
    trainer_device,
)
from draftsmith.distill.config.checks import check_schema
from draftsmith.distill.engine import warm_start
from draftsmith.distill.engine.best_export import KeepBestServed
from draftsmith.distill.engine.checkpoints import (
    CHECKPOINT_DIR,
    LAST_CHECKPOINT,
    QuotaCheckpoint,
    check_run_folder,
    resume_checkpoint,
)
from draftsmith.distill.engine.interrupts import (
    AtomicCheckpointIO,
    InterruptWatch,
    fit_or_interrupted,
    interruptible,
)
from draftsmith.distill.engine.module import DistillModule
from draftsmith.distill.engine.progress import StepProgressBar
from draftsmith.distill.engine.resume_check import (
    ApplyChangedOptim,
    check_resume_recipe,
    check_resume_shapes,
    read_checkpoint,
)
from draftsmith.distill.engine.run_logs import build_loggers, finish_loggers
from draftsmith.distill.target.frozen import Target
from draftsmith.distill.target.shard import TargetSharding, check_target_shard

log = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_DIR",
    "LAST_CHECKPOINT",
    "build_strategy",
    "build_trainer",
    "check_devices",
    "train",
]


def check_config(cfg: DictConfig, recipe: Any) -> None:
    """Fail fast, before the target loads: keys the schema lacks and values outside their declared
    ranges (:mod:`draftsmith.distill.config.checks`), missing required fields, devices,
    recipe-specific checks.
    """
    check_schema(cfg)
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(
            f"missing required config fields: {', '.join(missing)} (set them on the command line, "
            "e.g. target.name_or_path=/path/to/model)"
        )
    if cfg.target.name_or_path in (None, ""):
        raise ConfigError(
            "target.name_or_path is empty: point it at a HF causal-LM folder, or use the default "
            "`smollm2-135m`"
        )
    if (
        float(cfg.optim.lr) == 0
    ):  # allowed: runs the pipeline without moving a weight (checking an init or an export)
        log.warning("optim.lr=0: the weights will not change")
    check_devices(cfg.trainer)
    if recipe.validate is not None:
        recipe.validate(cfg)


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


def resume_path(cfg: DictConfig, run_dir: Path) -> str | None:
    """The newest intact checkpoint of the run folder (``last.ckpt``'s target, a newer SLURM requeue
    checkpoint, ...; a damaged or missing one skipped with a warning) when resuming is on."""
    if str(cfg.run.resume).lower() not in ("auto", "true", "changed"):
        return None
    found = resume_checkpoint(run_dir)
    if found is not None:
        log.info("resuming from %s", found)
    return str(found) if found is not None else None


def _scalars(metrics: dict) -> dict[str, float]:
    return {
        k: round(float(v), 5) for k, v in metrics.items() if torch.is_tensor(v) and v.numel() == 1
    }


def extra_callbacks(
    cfg: DictConfig, target: Any, run_dir: Path, shard_target: bool, served: bool, resumed: bool
) -> list:
    """Callbacks beyond the standard set: the sharded target's, and the best-served export's when a
    served-tau probe runs and ``validation.served_tau.keep_best`` is on."""
    extra: list = [TargetSharding(target, cfg.trainer)] if shard_target else []
    if (
        resumed and str(cfg.run.resume).lower() == "changed"
    ):  # the new optim values over the checkpoint's
        extra.append(ApplyChangedOptim())
    block = (cfg.get("validation") or {}).get("served_tau") or {}
    if served and bool(block.get("keep_best", True)) and bool(cfg.run.export):
        extra.append(KeepBestServed(run_dir, resumed=resumed))
    return extra


def validation_summary(module: Any, trainer: pl.Trainer) -> dict[str, Any]:
    """The last served-tau probe and the export kept as the best served one (with its step and tau),
    if any."""
    summary: dict[str, Any] = {}
    if module.served_validation is not None:
        summary["served_validation"] = module.served_validation
    keeper = next((c for c in trainer.callbacks if isinstance(c, KeepBestServed)), None)
    if keeper is not None and keeper.best is not None:
        summary["export_best"] = {**keeper.best, "path": str(keeper.out)}
    return summary


def distill_module(
    cfg: DictConfig, recipe_name: str, objective: Any, target: Any, served_probe: Any = None
) -> DistillModule:
    """The LightningModule of ``objective`` as configured: optimizer and schedule settings, the FSDP
    clip, the run's identity for checkpoints (recipe, target, resolved config) and activation
    checkpointing of the drafter.
    """
    module = DistillModule(
        objective,
        target,
        OmegaConf.to_container(cfg.optim, resolve=True),
        total_steps=int(cfg.trainer.max_steps),
        zero_loss_patience=int(cfg.run.zero_loss_patience),
        served_probe=served_probe,
        compile=bool(cfg.trainer.get("compile")),
    )
    module.sharded_clip_norm = sharded_clip_norm(cfg.optim, cfg.trainer)
    module.run_info = {
        "recipe": recipe_name,
        "target": target.identity(),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    wrapped = apply_activation_checkpointing(module.drafter, cfg.trainer)
    if wrapped:
        log.info("activation checkpointing: %s", ", ".join(sorted(c.__name__ for c in wrapped)))
    return module


def train(
    cfg: DictConfig,
    recipe: Any,
    run_dir: str | Path,
    run_name: str | None = None,
    served_probe: Any = None,
) -> dict[str, Any]:
    """Train ``recipe`` as configured; returns a summary (steps, tokens, seconds, export folder,
    metrics). ``run_name`` names the run in experiment trackers (train.py passes recipe +
    overrides); ``served_probe`` serves the current weights at validation
    (``DistillModule.served_probe``; train.py builds it, distill/ cannot).
    """
    from draftsmith.distill.data.datamodule import build_datamodule
    from draftsmith.distill.engine.exporting import export_from_module
    from draftsmith.distill.engine.objective import batch_kind

    run_dir = Path(run_dir)
    check_config(cfg, recipe)
    check_run_folder(run_dir)  # a file, or read-only: refused before the target loads
    apply_precision(cfg)
    shard_target = check_target_shard(cfg)
    ckpt_path = resume_path(cfg, run_dir)
    resumed = read_checkpoint(ckpt_path) if ckpt_path is not None else None
    if resumed is not None:  # another attempt, maybe on another device count: keep the global batch
        check_resume_recipe(resumed, ckpt_path, cfg, run_dir)
        keep_global_batch(cfg, read_global_batch(run_dir), planned_world_size(cfg.trainer))
    pl.seed_everything(int(cfg.run.seed), workers=True)
    if cfg.data.features:  # offline: the feature cache's stand-in; the target model is never loaded
        from draftsmith.distill.feature_cache.cached_data import CachedTarget, open_cache

        target = CachedTarget(open_cache(cfg))
    else:
        target = Target.load(
            cfg.target.name_or_path,
            cfg.target.dtype,
            trust_remote_code=bool(cfg.target.trust_remote_code),
            runs_on=run_device(cfg.trainer),
        )
    objective = recipe.build(cfg, target)
    data = build_datamodule(cfg, target.tokenizer, kind=batch_kind(objective))
    prior = warm_start.prepare(
        cfg, objective, target, data, run_dir, resuming=ckpt_path is not None
    )
    module = distill_module(cfg, recipe.name, objective, target, served_probe)
    if resumed is not None:  # before Lightning's `Missing key(s) in state_dict`
        check_resume_shapes(resumed, ckpt_path, cfg, module, run_dir, target=target)
    extra = extra_callbacks(
        cfg,
        target,
        run_dir,
        shard_target,
        served=served_probe is not None,
        resumed=ckpt_path is not None,
    ) + [warm_start.SittingLog(run_dir)]
    trainer = build_trainer(
        cfg, run_dir, callbacks=extra, drafter=module.drafter, run_name=run_name
    )
    start = time.perf_counter()
    fit_or_interrupted(trainer, module, data, ckpt_path, run_dir, int(cfg.run.checkpoint_every))
    seconds = time.perf_counter() - start
    metrics = _scalars(trainer.callback_metrics)
    if int(cfg.run.final_eval_batches) > 0 and data.val_set is not None and len(data.val_set) > 0:
        interruptible(
            trainer,
            run_dir,
            int(cfg.run.checkpoint_every),
            trainer.validate,
            module,
            datamodule=data,
            verbose=False,
        )  # Ctrl-C here: the interruption too, not Lightning's exit 1
        metrics.update(_scalars(trainer.callback_metrics))
    summary = {
        "recipe": recipe.name,
        "steps": int(trainer.global_step),
        "tokens": int(module.tokens_seen),
        "fit_seconds": round(seconds, 1),
        "metrics": metrics,
        "run_dir": str(run_dir),
    }
    summary["lineage"] = warm_start.lineage(
        cfg, prior, summary["steps"], summary["tokens"], run_dir
    )
    if cfg.run.export and trainer.is_global_zero:
        out = export_from_module(module, run_dir / "export", training=summary)
        summary["export"] = str(out)
        log.info("exported %s drafter to %s", recipe.name, out)
    summary.update(
        validation_summary(module, trainer)
    )  # after the export, whose config.json holds `validation`
    finish_loggers(trainer.loggers, Path(summary["export"]) if "export" in summary else None)
    return summary
