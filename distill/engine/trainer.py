"""Run a training job from a composed config: target, data, objective, Lightning Trainer,
checkpoints, export."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.common.errors import ConfigError
from draftsmith.distill.cluster.attempts import (
    keep_global_batch,
    planned_world_size,
    read_global_batch,
)
from draftsmith.distill.cluster.strategies import apply_activation_checkpointing, check_devices
from draftsmith.distill.config.checks import check_schema
from draftsmith.distill.engine import warm_start
from draftsmith.distill.engine.best_export import KeepBestServed
from draftsmith.distill.engine.checkpoints import check_run_folder
from draftsmith.distill.engine.interrupts import fit_or_interrupted, interruptible
from draftsmith.distill.engine.lightning_trainer import (
    apply_precision,
    build_trainer,
    run_device,
    sharded_clip_norm,
)
from draftsmith.distill.engine.module import DistillModule
from draftsmith.distill.engine.resume_check import (
    ApplyChangedOptim,
    check_resume_recipe,
    check_resume_shapes,
    read_checkpoint,
)
from draftsmith.distill.engine.resume_point import resume_checkpoint
from draftsmith.distill.engine.run_logs import finish_loggers
from draftsmith.distill.target.frozen import Target
from draftsmith.distill.target.shard import TargetSharding, check_target_shard

log = logging.getLogger(__name__)


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
    # allowed: runs the pipeline without moving a weight (checking an init or an export)
    if float(cfg.optim.lr) == 0:
        log.warning("optim.lr=0: the weights will not change")
    check_devices(cfg.trainer)
    if recipe.validate is not None:
        recipe.validate(cfg)


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
    # the new optim values over the checkpoint's
    if resumed and str(cfg.run.resume).lower() == "changed":
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
    from draftsmith.distill.engine.objective import batch_kind

    run_dir = Path(run_dir)
    check_config(cfg, recipe)
    check_run_folder(run_dir)  # a file, or read-only: refused before the target loads
    apply_precision(cfg)
    shard_target = check_target_shard(cfg)
    ckpt_path, resumed = resume_state(cfg, run_dir)
    pl.seed_everything(int(cfg.run.seed), workers=True)
    target = load_target(cfg)
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
    summary = {
        "recipe": recipe.name,
        "steps": int(trainer.global_step),
        "tokens": int(module.tokens_seen),
        "fit_seconds": round(seconds, 1),
        "metrics": final_metrics(cfg, trainer, module, data, run_dir),
        "run_dir": str(run_dir),
    }
    summary["lineage"] = warm_start.lineage(
        cfg, prior, summary["steps"], summary["tokens"], run_dir
    )
    return finish_run(cfg, trainer, module, summary)


def resume_state(cfg: DictConfig, run_dir: Path) -> tuple[str | None, Any]:
    """The checkpoint this run resumes from (None: a fresh start) and what it records, checked
    against the recipe; another attempt, maybe on another device count, keeps the global batch."""
    ckpt_path = resume_path(cfg, run_dir)
    resumed = read_checkpoint(ckpt_path) if ckpt_path is not None else None
    if resumed is not None:
        check_resume_recipe(resumed, ckpt_path, cfg, run_dir)
        keep_global_batch(cfg, read_global_batch(run_dir), planned_world_size(cfg.trainer))
    return ckpt_path, resumed


def load_target(cfg: DictConfig) -> Any:
    """The frozen target of ``cfg``; with ``data.features`` the feature cache's stand-in (the target
    model is never loaded)."""
    if cfg.data.features:
        from draftsmith.distill.feature_cache.cached_data import open_cache
        from draftsmith.distill.feature_cache.cached_target import CachedTarget

        return CachedTarget(open_cache(cfg))
    return Target.load(
        cfg.target.name_or_path,
        cfg.target.dtype,
        trust_remote_code=bool(cfg.target.trust_remote_code),
        runs_on=run_device(cfg.trainer),
    )


def final_metrics(
    cfg: DictConfig, trainer: pl.Trainer, module: DistillModule, data: Any, run_dir: Path
) -> dict[str, float]:
    """The scalar metrics at the end of fitting, updated by a final validation pass of
    ``run.final_eval_batches`` batches when there is a validation set."""
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
    return metrics


def finish_run(
    cfg: DictConfig, trainer: pl.Trainer, module: DistillModule, summary: dict[str, Any]
) -> dict[str, Any]:
    """Export the drafter (``run.export``, on rank 0), add the served-validation results to
    ``summary`` and close the loggers; returns ``summary``."""
    from draftsmith.distill.engine.exporting import export_from_module

    run_dir = Path(summary["run_dir"])
    if cfg.run.export and trainer.is_global_zero:
        out = export_from_module(module, run_dir / "export", training=summary)
        summary["export"] = str(out)
        log.info("exported %s drafter to %s", summary["recipe"], out)
    summary.update(
        validation_summary(module, trainer)
    )  # after the export, whose config.json holds `validation`
    finish_loggers(trainer.loggers, Path(summary["export"]) if "export" in summary else None)
    return summary
