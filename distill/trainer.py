"""Run a training job from a composed config: target, data, objective, Lightning Trainer, checkpoints, export."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.io import TorchCheckpointIO

from draftsmith.distill.errors import ConfigError
from draftsmith.distill.module import DistillModule
from draftsmith.distill.progress import StepProgressBar
from draftsmith.distill.target import Target

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
CLIP_ALGORITHMS = ("norm", "value")
# Lightning strategies that run on CUDA GPUs only (fsdp, deepspeed_stage_2, deepspeed_stage_3_offload, ...).
_CUDA_ONLY_STRATEGIES = ("fsdp", "deepspeed")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temp file, fsyncs, then renames: a kill mid-write never corrupts ``last.ckpt``."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as fh:
            torch.save(checkpoint, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)


def check_devices(trainer_cfg: DictConfig, cuda_available: bool | None = None) -> None:
    """Refuse a CUDA-only trainer preset (``trainer=gpu``, ``fsdp``, ``deepspeed_*``) on a machine without CUDA with
    one line naming the CPU presets, before Lightning fails with its own less helpful error."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if cuda_available:
        return
    accelerator, strategy = str(trainer_cfg.accelerator).lower(), str(trainer_cfg.strategy).lower()
    if accelerator in ("gpu", "cuda"):
        why = f"trainer.accelerator={accelerator}"
    elif strategy.startswith(_CUDA_ONLY_STRATEGIES):
        why = f"trainer.strategy={strategy}"
    else:
        return
    raise ConfigError(f"{why} needs a CUDA GPU and this machine has none (torch.cuda.is_available() is False); "
                      "train on CPU with trainer=cpu, or trainer=ddp trainer.accelerator=cpu for 2 processes")


def check_config(cfg: DictConfig, recipe: Any) -> None:
    """Fail fast, before the target loads: missing required fields, bad values, devices, recipe-specific checks."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"missing required config fields: {', '.join(missing)} (set them on the command line, "
                          "e.g. target.name_or_path=/path/to/model)")
    if cfg.target.name_or_path in (None, ""):
        raise ConfigError("target.name_or_path is empty: point it at a HF causal-LM folder, or use the default "
                          "`smollm2-135m`")
    if int(cfg.trainer.max_steps) < 1:
        raise ConfigError(f"trainer.max_steps must be >= 1, got {cfg.trainer.max_steps}")
    if int(cfg.data.max_length) < 8:
        raise ConfigError(f"data.max_length must be >= 8, got {cfg.data.max_length}")
    algorithm = str(cfg.optim.get("grad_clip_algorithm", "norm"))
    if algorithm not in CLIP_ALGORITHMS:
        raise ConfigError(f"optim.grad_clip_algorithm={algorithm!r}; valid: {', '.join(CLIP_ALGORITHMS)}")
    check_devices(cfg.trainer)
    if recipe.validate is not None:
        recipe.validate(cfg)


def build_loggers(cfg: DictConfig, run_dir: Path) -> list:
    """CSV always; wandb (offline unless logger.mode=online) when selected."""
    from pytorch_lightning.loggers import CSVLogger

    loggers: list = [CSVLogger(save_dir=str(run_dir), name="logs", version="")]
    kind = cfg.logger.get("kind", "csv")
    if kind == "wandb":
        from pytorch_lightning.loggers import WandbLogger

        mode = str(cfg.logger.get("mode", "offline"))
        if mode not in ("offline", "online", "disabled"):
            raise ConfigError(f"logger.mode={mode!r}; valid: offline, online, disabled")
        os.environ.setdefault("WANDB_MODE", mode)
        loggers.append(WandbLogger(project=cfg.logger.project, entity=cfg.logger.get("entity"),
                                   save_dir=str(run_dir), offline=mode == "offline", mode=mode))
    elif kind != "csv":
        raise ConfigError(f"logger.kind={kind!r}; valid: csv, wandb")
    return loggers


def build_strategy(trainer_cfg: DictConfig) -> Any:
    """The Lightning strategy for ``trainer.strategy``.

    ``ddp`` gets ``broadcast_buffers=False``: drafters hold the frozen target embedding / LM head as (identical,
    non-persistent) buffers, and re-broadcasting them every step would move hundreds of MB for nothing.
    On CPU, DDP uses gloo.
    """
    name = str(trainer_cfg.strategy)
    if name == "ddp":
        from pytorch_lightning.strategies import DDPStrategy

        backend = "gloo" if str(trainer_cfg.accelerator) == "cpu" else None
        return DDPStrategy(broadcast_buffers=False, process_group_backend=backend)
    return name


def run_device(trainer_cfg: DictConfig) -> str:
    """The device type the trainer will place the target on (``cuda`` or ``cpu``), for ``target.dtype=auto``."""
    accelerator = str(trainer_cfg.accelerator).lower()
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def grad_clipping(optim_cfg: DictConfig) -> dict[str, Any]:
    """Lightning's ``gradient_clip_val`` / ``gradient_clip_algorithm`` from ``optim.grad_clip`` (0 = off) and
    ``optim.grad_clip_algorithm`` (``norm``: rescale the global gradient norm; ``value``: clamp each element)."""
    value = float(optim_cfg.grad_clip or 0.0)
    if not value:
        return {"gradient_clip_val": None, "gradient_clip_algorithm": None}
    return {"gradient_clip_val": value, "gradient_clip_algorithm": str(optim_cfg.get("grad_clip_algorithm", "norm"))}


def build_trainer(cfg: DictConfig, run_dir: Path, callbacks: list | None = None) -> pl.Trainer:
    """A Lightning Trainer from ``cfg.trainer`` with atomic checkpoints every ``run.checkpoint_every`` steps and a
    step-based progress bar (:class:`~draftsmith.distill.progress.StepProgressBar`)."""
    t = cfg.trainer
    check_devices(t)
    checkpoint = ModelCheckpoint(dirpath=str(run_dir / CHECKPOINT_DIR), filename="step{step}",
                                 auto_insert_metric_name=False, every_n_train_steps=int(cfg.run.checkpoint_every),
                                 save_last=True, save_top_k=1, monitor=None)
    val_every = int(cfg.run.val_every)
    return pl.Trainer(
        accelerator=t.accelerator, devices=t.devices, strategy=build_strategy(t), precision=t.precision,
        max_steps=int(t.max_steps), max_time=t.get("max_time") or None,
        accumulate_grad_batches=int(t.accumulate_grad_batches),
        **grad_clipping(cfg.optim), log_every_n_steps=int(t.log_every_n_steps),
        val_check_interval=val_every if val_every > 0 else None, check_val_every_n_epoch=None if val_every else 1,
        limit_val_batches=int(cfg.run.final_eval_batches), num_sanity_val_steps=0,
        logger=build_loggers(cfg, run_dir), callbacks=[checkpoint, StepProgressBar(), *(callbacks or [])],
        plugins=[AtomicCheckpointIO()], default_root_dir=str(run_dir), enable_model_summary=False,
        use_distributed_sampler=True,
    )


def resume_path(cfg: DictConfig, run_dir: Path) -> str | None:
    """``<run dir>/checkpoints/last.ckpt`` when resuming is on and it exists."""
    last = run_dir / CHECKPOINT_DIR / LAST_CHECKPOINT
    if str(cfg.run.resume).lower() in ("auto", "true") and last.is_file():
        log.info("resuming from %s", last)
        return str(last)
    return None


def _scalars(metrics: dict) -> dict[str, float]:
    return {k: round(float(v), 5) for k, v in metrics.items() if torch.is_tensor(v) and v.numel() == 1}


def train(cfg: DictConfig, recipe: Any, run_dir: str | Path) -> dict[str, Any]:
    """Train ``recipe`` as configured; returns a summary (steps, tokens, seconds, export folder, metrics)."""
    from draftsmith.distill.datamodule import build_datamodule
    from draftsmith.distill.exporting import export_from_module
    from draftsmith.distill.objective import batch_kind

    run_dir = Path(run_dir)
    check_config(cfg, recipe)
    pl.seed_everything(int(cfg.run.seed), workers=True)
    target = Target.load(cfg.target.name_or_path, cfg.target.dtype, trust_remote_code=bool(cfg.target.trust_remote_code),
                         runs_on=run_device(cfg.trainer))
    objective = recipe.build(cfg, target)
    data = build_datamodule(cfg, target.tokenizer, kind=batch_kind(objective))
    module = DistillModule(objective, target, OmegaConf.to_container(cfg.optim, resolve=True),
                           total_steps=int(cfg.trainer.max_steps))
    module.run_info = {"recipe": recipe.name, "target": target.identity(),
                       "config": OmegaConf.to_container(cfg, resolve=True)}
    trainer = build_trainer(cfg, run_dir)
    start = time.perf_counter()
    trainer.fit(module, datamodule=data, ckpt_path=resume_path(cfg, run_dir))
    seconds = time.perf_counter() - start
    metrics = _scalars(trainer.callback_metrics)
    if int(cfg.run.final_eval_batches) > 0 and data.val_set is not None and len(data.val_set) > 0:
        trainer.validate(module, datamodule=data, verbose=False)
        metrics.update(_scalars(trainer.callback_metrics))
    summary = {"recipe": recipe.name, "steps": int(trainer.global_step), "tokens": int(module.tokens_seen),
               "fit_seconds": round(seconds, 1), "metrics": metrics, "run_dir": str(run_dir)}
    if cfg.run.export and trainer.is_global_zero:
        out = export_from_module(module, run_dir / "export", training=summary)
        summary["export"] = str(out)
        log.info("exported %s drafter to %s", recipe.name, out)
    return summary
