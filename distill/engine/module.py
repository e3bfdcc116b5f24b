"""The one LightningModule: frozen target forward (no grad) -> drafter forward -> loss.

A training step reads nothing back from the device: the guards
(:mod:`draftsmith.distill.engine.callbacks.guards`) fold each step's loss into device tensors read
on log steps, metrics are logged on log steps only (not through the progress bar, which would read
them every step), and tokens are counted on the host batch before it moves. The served-tau probe,
the objective's validation hooks and the ZeRO-3 fix-up are callbacks the module brings along
(:meth:`DistillModule.configure_callbacks`); the learning-rate schedule is
:mod:`draftsmith.distill.engine.schedule`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision, Precision
from pytorch_lightning.utilities import GradClipAlgorithmType

from draftsmith.common.errors import ConfigError
from draftsmith.distill.engine.callbacks.guards import GuardState, TrainingGuards, is_log_step
from draftsmith.distill.engine.callbacks.validation import (
    ObjectiveValidationHooks,
    ServedProbe,
    ServedTauProbe,
)
from draftsmith.distill.engine.callbacks.zero3 import ZeroThreeDevices
from draftsmith.distill.engine.compiled import CompiledStep
from draftsmith.distill.engine.objective import Objective, optimizer_groups
from draftsmith.distill.engine.schedule import lr_lambda
from draftsmith.distill.feature_cache.cached_target import CachedTarget
from draftsmith.distill.target.frozen import TargetModel

BATCH_FEATURE_KEYS = (
    "position_ids",
    "document_ids",
)  # packed rows' extras the target forward takes


class DistillModule(pl.LightningModule):
    """Online distillation of ``objective.module`` from a frozen ``target``.

    The target is held outside the module tree's state (``_target`` is excluded from
    ``state_dict``), so checkpoints hold the drafter, optimizer and schedule only, and hparams never
    contain it. A trainable adapter the target carries (Medusa-2's LoRA,
    :meth:`~draftsmith.distill.target.frozen.Target.attach_lora`) is registered in the objective's
    module too, so it is optimised, checkpointed and exported with it.

    The objective's hooks (:class:`~draftsmith.distill.engine.objective.Objective`):
    ``set_step(global_step)`` before each training step; ``on_validation_start()`` /
    ``on_validation_end(reduce_sum)`` around each validation pass
    (:class:`~draftsmith.distill.engine.callbacks.validation.ObjectiveValidationHooks`).

    ``compile`` (``trainer.compile``): the target forward and the loss through ``torch.compile``
    after the first step (:mod:`draftsmith.distill.engine.compiled`).

    ``served_probe`` (optional, see
    :data:`~draftsmith.distill.engine.callbacks.validation.ServedProbe`) serves the weights at
    validation (:class:`~draftsmith.distill.engine.callbacks.validation.ServedTauProbe`); its last
    record is kept in :attr:`served_validation` for the export.
    """

    def __init__(
        self,
        objective: Objective,
        target: TargetModel,
        optim: dict[str, Any],
        total_steps: int,
        zero_loss_patience: int = 5,
        served_probe: ServedProbe | None = None,
        compile: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(objective, Objective):
            raise TypeError(
                f"{type(objective).__name__} is not a"
                " draftsmith.distill.engine.objective.Objective; recipes build objectives that"
                " subclass it"
            )
        self.objective = objective
        self.drafter = objective.module
        object.__setattr__(
            self, "_target", target
        )  # not a registered submodule: never saved, never optimised
        self.optim_cfg = dict(optim)
        self.total_steps = total_steps
        self.save_hyperparameters({"optim": self.optim_cfg, "total_steps": total_steps})
        self._tokens_seen = 0
        self._target_seconds = 0.0
        self.guards = GuardState(
            zero_loss_patience
        )  # device-side record of faults, read on log steps
        self.run_info: dict[
            str, Any
        ] = {}  # recipe name, target identity, resolved config (set by the trainer)
        # serving code handed in by the entry point: distill/ never imports it
        self.served_probe = served_probe
        # the last probe's record, written into the export
        self.served_validation: dict[str, Any] | None = None
        # FSDP: clip the global norm here (set by the trainer)
        self.sharded_clip_norm: float | None = None
        # the training loss read at the last log step (progress bar)
        self.last_logged_loss: float | None = None
        self.compiled = CompiledStep(
            enabled=bool(compile)
        )  # trainer.compile: the target forward and the loss
        self._callbacks = [
            TrainingGuards(self.guards),
            ObjectiveValidationHooks(),
            ServedTauProbe(),
            ZeroThreeDevices(),
        ]

    @property
    def target(self) -> TargetModel:
        return self._target

    def configure_callbacks(self) -> list[pl.Callback]:
        """The guards, the objective's validation hooks, the served-tau probe and the ZeRO-3 fix-up,
        in that order (the probe serves what the objective's end hook calibrated)."""
        return list(self._callbacks)

    def configure_gradient_clipping(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's clipping, except under FSDP with norm clipping: the wrapped root's
        ``clip_grad_norm_`` computes the norm over every shard (Lightning's FSDP precision plugin
        refuses ``norm``); and under ``bf16-mixed`` with the fused AdamW, which Lightning's mixed
        precision refuses to clip for.
        """
        if self.sharded_clip_norm:
            self.trainer.strategy.model.clip_grad_norm_(self.sharded_clip_norm)
            return
        plugin = self.trainer.precision_plugin
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        if isinstance(plugin, MixedPrecision) and plugin.scaler is None and fused:
            # bf16-mixed has no GradScaler, so the gradients are already true: clipping is sound
            # with the fused AdamW, but Lightning's MixedPrecision refuses any fused optimizer; clip
            # as its base plugin does.
            algorithm = GradClipAlgorithmType(gradient_clip_algorithm or "norm")
            Precision.clip_gradients(plugin, optimizer, float(gradient_clip_val or 0.0), algorithm)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    @property
    def tokens_seen(self) -> int:
        """Non-padding tokens trained on so far (this process)."""
        return self._tokens_seen

    def on_fit_start(self) -> None:
        if isinstance(
            self._target, CachedTarget
        ):  # a feature cache: refuse taps it does not hold before step 1
            self._target.check_taps(self.objective.taps, own_features=self.objective.own_features)
        self._target.to(self.device)
        # never registered: never saved, never optimised
        for model in self.objective.frozen.values():
            model.to(self.device).eval().requires_grad_(False)

    def _step(
        self, batch: dict[str, torch.Tensor], with_logits: bool = False, training: bool = False
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        taps = replace(self.objective.taps, logits=True) if with_logits else self.objective.taps
        features, loss = (
            self.compiled.parts(self._target, self.objective)
            if training
            else (None, self.objective.loss)
        )  # features: the target's, looked up only when run
        start = time.perf_counter()
        if isinstance(
            self._target, CachedTarget
        ):  # offline (data.features): the batch carries the features
            feats, batch = self._target.batch_features(batch, taps)
        elif self.objective.own_features:
            feats = self.objective.features(
                self._target, batch
            )  # own forwards (several, a layer range, ...)
        else:
            extras = {
                k: batch[k] for k in BATCH_FEATURE_KEYS if k in batch
            }  # packed rows: documents, positions
            feats = (features or self._target.features)(
                batch["input_ids"], batch["attention_mask"], taps, **extras
            )
        self._target_seconds += time.perf_counter() - start
        return loss(batch, feats)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Count the tokens of a training batch while it is still on the host (no device
        read-back)."""
        if self._trainer is not None and self.trainer.training and isinstance(batch, dict):
            # Batch kinds without a token mask (trajectories) say how many examples they hold.
            mask = batch.get("attention_mask")
            self._tokens_seen += (
                int(batch["num_tokens"])
                if "num_tokens" in batch
                else (int(mask.sum()) if mask is not None else 0)
            )
        return batch

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        step = int(self.global_step)
        self.objective.set_step(
            step
        )  # step-dependent objectives (head warmup) read the global step
        loss, metrics = self._step(batch, training=True)
        self.guards.observe(step, loss, self._scored(batch))
        if is_log_step(self.trainer, step) or step + 1 >= self.total_steps:
            self._log_training(loss, metrics, batch["input_ids"].shape[0])
        return loss

    def _scored(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | int | None:
        """Positions the batch scored: the objective's count (a tensor or int), else its loss
        mask's, else None."""
        scored = getattr(self.objective, "last_scored", None)
        if scored is None and "loss_mask" in batch:
            scored = (batch["loss_mask"].bool() & batch["attention_mask"].bool()).sum()
        return scored

    def _log_training(
        self, loss: torch.Tensor, metrics: dict[str, torch.Tensor], size: int
    ) -> None:
        """Log the step's loss and metrics (a log step: Lightning reads them back once, here)."""
        self.log("train/loss", loss.detach(), batch_size=size)
        self.log_dict({f"train/{k}": v for k, v in metrics.items()}, batch_size=size)
        self.log("train/tokens", float(self._tokens_seen), reduce_fx="max")
        self.last_logged_loss = float(loss.detach())

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        # Validation also asks for the target's logits so objectives can report agreement with its
        # greedy tokens.
        loss, metrics = self._step(batch, with_logits=True)
        size = batch["input_ids"].shape[0]
        self.log("val/loss", loss, prog_bar=True, batch_size=size, sync_dist=True)
        self.log_dict({f"val/{k}": v for k, v in metrics.items()}, batch_size=size, sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        cfg = self.optim_cfg
        try:
            groups = optimizer_groups(self.objective, float(cfg["lr"]))
        except ValueError as err:
            raise ConfigError(str(err)) from None
        optimizer = torch.optim.AdamW(
            groups,
            lr=float(cfg["lr"]),
            weight_decay=float(cfg.get("weight_decay", 0.0)),
            betas=tuple(cfg.get("betas", (0.9, 0.999))),
            eps=float(cfg.get("eps", 1e-8)),
            fused=self._fused_optimizer(groups) or None,
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lr_lambda(
                str(cfg.get("scheduler", "cosine")),
                int(cfg.get("warmup_steps", 0)),
                self.total_steps,
                decay_steps=int(cfg.get("decay_steps") or 0),
            ),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def _fused_optimizer(self, groups: list[dict[str, Any]]) -> bool:
        """AdamW's fused kernel (one launch for every parameter, step counts on the device: no
        read-back) where the parameters are plain CPU / CUDA tensors, no sharded strategy wraps the
        optimizer and no GradScaler scales the gradients that are clipped (``16-mixed``; under
        ``bf16-mixed`` :meth:`configure_gradient_clipping` clips).
        """
        strategy = (
            type(self._trainer.strategy).__name__
            if self._trainer is not None
            else "SingleDeviceStrategy"
        )
        devices = {p.device.type for group in groups for p in group["params"]}
        plugin = self._trainer.precision_plugin if self._trainer is not None else None
        if (
            isinstance(plugin, MixedPrecision)
            and plugin.scaler is not None
            and self._trainer.gradient_clip_val
        ):
            # 16-mixed: a fused step unscales inside it, so a clip before it would see scaled
            # gradients
            return False
        return (
            strategy in ("SingleDeviceStrategy", "DDPStrategy")
            and devices <= {"cpu", "cuda"}
            and bool(devices)
        )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Everything `draftsmith export CHECKPOINT` needs, so exporting never has to reload the
        # target.
        checkpoint["draftsmith"] = {
            "tokens_seen": self._tokens_seen,
            "export_config": self.objective.export_config(),
            **self.run_info,
        }
        # `draftsmith export CHECKPOINT` keeps the last served tau
        if self.served_validation is not None:
            checkpoint["draftsmith"]["validation"] = self.served_validation

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._tokens_seen = int(checkpoint.get("draftsmith", {}).get("tokens_seen", 0))
        self.served_validation = checkpoint.get("draftsmith", {}).get(
            "validation", self.served_validation
        )
