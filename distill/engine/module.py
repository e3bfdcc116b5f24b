"""The one LightningModule: frozen target forward (no grad) -> drafter forward -> loss."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from draftsmith.common.errors import ConfigError, DraftsmithError
from draftsmith.distill.engine.objective import Objective, optimizer_groups
from draftsmith.distill.feature_cache.cached_data import CachedTarget
from draftsmith.distill.target.frozen import TargetModel

log = logging.getLogger(__name__)


class NonFiniteLossError(DraftsmithError, RuntimeError):
    """The training loss became NaN or inf; the run stops (any checkpoint written before stays intact)."""


class NothingScoredError(DraftsmithError, RuntimeError):
    """The first training batches score no position at all: the run would train on a zero loss and export noise."""


class ZeroLossError(DraftsmithError, RuntimeError):
    """The training loss was exactly zero for ``run.zero_loss_patience`` consecutive steps: nothing is learned."""


# The seam for serving-faithful validation: export folder -> {"served_tau": float, ...}, or None when the runtime
# serves nothing for this method. Optional attributes: ``every`` (probe every N-th validation pass) and
# ``serves(method) -> bool`` (skip the temporary export for methods it would not serve).
ServedProbe = Callable[[Path], "dict[str, Any] | None"]
SCORED_CHECK_BATCHES = 4  # the first batches of a run that must score some position between them


def nothing_scored_message(batches: int, step: int, reason: str | None) -> str:
    why = reason or ("their loss masks select no token: no assistant reply survives data.max_length, or the chat "
                     "template marks no assistant turn")
    return (f"nothing to train on: the first {batches} training batch(es) score no position ({why}); stopping at "
            f"step {step} instead of training on a zero loss")


def nonfinite_message(loss: float, step: int, checkpoint: str | None) -> str:
    """What to tell the user when the loss is ``loss`` at ``step``: where the last good checkpoint is, or that none
    was written yet, and what to try."""
    if checkpoint:
        where = f"The last good checkpoint is intact: {checkpoint}."
    else:
        where = ("No checkpoint was written yet (the first comes after run.checkpoint_every steps), so a re-run "
                 "starts from scratch.")
    return (f"loss is {loss} at step {step}; stopping. {where} Lower optim.lr, check the data, or use fp32 "
            "(target.dtype=fp32).")


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.1, decay_steps: int = 0):
    """Multiplier of the base LR at a step: linear warmup, then constant / linear / cosine decay to ``min_ratio``, or
    ``wsd`` (warmup-stable-decay): constant, then linear to zero over the last ``decay_steps`` steps (the factor is
    ``(total_steps - step) / decay_steps``: 1 at the decay's first step, 0 at ``total_steps``). A cooldown branch of
    a constant-LR run is a ``wsd`` run resumed from the branch point (Hagele et al., arXiv 2405.18392)."""
    if schedule not in ("constant", "linear", "cosine", "wsd"):
        raise ConfigError(f"optim.scheduler={schedule!r}; valid: constant, linear, cosine, wsd")
    if schedule == "wsd" and decay_steps < 1:
        raise ConfigError("optim.scheduler=wsd needs optim.decay_steps >= 1 (the steps of its linear decay to zero)")

    def fn(step: int) -> float:
        if schedule == "wsd" and step >= total_steps - decay_steps:
            return max(0.0, (total_steps - step) / decay_steps)
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule in ("constant", "wsd") or total_steps <= warmup_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            return 1.0 - (1.0 - min_ratio) * progress
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn



def move_parameter(param: torch.nn.Parameter, device: torch.device) -> None:
    """Move ``param`` to ``device`` in place, keeping its identity and attributes (the optimizer and DeepSpeed's
    ``ds_*`` bookkeeping refer to the object). ``param.data = ...`` is how ``Module.to`` moves parameters between
    CPU and CUDA; where the tensor types differ (e.g. to "meta") the contents are swapped and the attributes kept."""
    moved = param.data.to(device)
    if torch._has_compatible_shallow_copy_type(param.data, moved):
        param.data = moved
        return
    attributes = dict(param.__dict__)
    torch.utils.swap_tensors(param, torch.nn.Parameter(moved, requires_grad=param.requires_grad))
    param.__dict__.update(attributes)  # swap_tensors swaps __dict__ too

class DistillModule(pl.LightningModule):
    """Online distillation of ``objective.module`` from a frozen ``target``.

    The target is held outside the module tree's state (``_target`` is excluded from ``state_dict``), so
    checkpoints hold the drafter, optimizer and schedule only, and hparams never contain it. A trainable adapter
    the target carries (Medusa-2's LoRA, :meth:`~draftsmith.distill.target.frozen.Target.attach_lora`) is registered in
    the objective's module too, so it is optimised, checkpointed and exported with it.

    The objective's hooks (:class:`~draftsmith.distill.engine.objective.Objective`) are called directly:
    ``set_step(global_step)`` before each training step; ``on_validation_start()`` / ``on_validation_end(reduce_sum)``
    around each validation pass (``reduce_sum`` sums a tensor over processes under DDP, else None).

    ``served_probe`` (optional, see :data:`ServedProbe`): at the end of every ``served_probe.every``-th validation
    pass and of a final ``trainer.validate``, the current weights are exported to a temporary folder and served by
    the runtime; its tau is logged as ``val/served_tau`` and kept in :attr:`served_validation` for the export.
    """

    def __init__(self, objective: Objective, target: TargetModel, optim: dict[str, Any], total_steps: int,
                 zero_loss_patience: int = 5, served_probe: ServedProbe | None = None) -> None:
        super().__init__()
        if not isinstance(objective, Objective):
            raise TypeError(f"{type(objective).__name__} is not a draftsmith.distill.engine.objective.Objective; "
                            "recipes build objectives that subclass it")
        self.objective = objective
        self.drafter = objective.module
        object.__setattr__(self, "_target", target)  # not a registered submodule: never saved, never optimised
        self.optim_cfg = dict(optim)
        self.total_steps = total_steps
        self.save_hyperparameters({"optim": self.optim_cfg, "total_steps": total_steps})
        self._tokens_seen = 0
        self._target_seconds = 0.0
        self.zero_loss_patience = int(zero_loss_patience or 0)  # 0 = never stop on a zero loss
        self._zero_steps = 0  # consecutive training steps whose loss was exactly 0
        self._scored_batches = self._scored_positions = 0  # over this process's first SCORED_CHECK_BATCHES batches
        self.run_info: dict[str, Any] = {}  # recipe name, target identity, resolved config (set by the trainer)
        self.served_probe = served_probe  # serving code handed in by the entry point: distill/ never imports it
        self.served_validation: dict[str, Any] | None = None  # the last probe's record, written into the export
        self._validations = 0  # validation passes seen, for the probe's ``every``
        self.sharded_clip_norm: float | None = None  # FSDP: clip the global norm here (set by the trainer)

    @property
    def target(self) -> TargetModel:
        return self._target

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Lightning's clipping, except under FSDP with norm clipping: the wrapped root's ``clip_grad_norm_``
        computes the norm over every shard (Lightning's FSDP precision plugin refuses ``norm``)."""
        if self.sharded_clip_norm:
            self.trainer.strategy.model.clip_grad_norm_(self.sharded_clip_norm)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    @property
    def tokens_seen(self) -> int:
        """Non-padding tokens trained on so far (this process)."""
        return self._tokens_seen

    def on_fit_start(self) -> None:
        if isinstance(self._target, CachedTarget):  # a feature cache: refuse taps it does not hold before step 1
            self._target.check_taps(self.objective.taps, own_features=self.objective.own_features)
        self._target.to(self.device)
        for model in self.objective.frozen.values():  # never registered: never saved, never optimised
            model.to(self.device).eval().requires_grad_(False)

    def _step(
        self, batch: dict[str, torch.Tensor], with_logits: bool = False
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        taps = replace(self.objective.taps, logits=True) if with_logits else self.objective.taps
        start = time.perf_counter()
        if isinstance(self._target, CachedTarget):  # offline (data.features): the batch carries the features
            feats, batch = self._target.batch_features(batch, taps)
        elif self.objective.own_features:
            feats = self.objective.features(self._target, batch)  # own forwards (several, a layer range, ...)
        else:
            feats = self._target.features(batch["input_ids"], batch["attention_mask"], taps)
        self._target_seconds += time.perf_counter() - start
        return self.objective.loss(batch, feats)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # step-dependent objectives (head warmup) read the global step, which survives resume
        self.objective.set_step(int(self.global_step))
        loss, metrics = self._step(batch)
        if not torch.isfinite(loss):
            raise NonFiniteLossError(nonfinite_message(loss.item(), self.global_step, self._last_checkpoint()))
        self._check_scored(batch)
        self._check_zero_loss(loss)
        # Batch kinds without a token mask (trajectories) say how many examples they hold.
        tokens = int(batch["num_tokens"]) if "num_tokens" in batch else int(batch["attention_mask"].sum())
        self._tokens_seen += tokens
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        self.log_dict({f"train/{k}": v for k, v in metrics.items()}, batch_size=batch["input_ids"].shape[0])
        self.log("train/tokens", float(self._tokens_seen), reduce_fx="max")
        return loss

    def _check_scored(self, batch: dict[str, torch.Tensor]) -> None:
        """Stop at the first batches when none of them scores a position (the objective's ``last_scored`` count,
        else the batch's loss mask); batch kinds without either are not checked."""
        if self._scored_batches >= SCORED_CHECK_BATCHES:
            return
        scored = getattr(self.objective, "last_scored", None)
        if scored is None:
            if "loss_mask" not in batch:
                return
            scored = int((batch["loss_mask"].bool() & batch["attention_mask"].bool()).sum())
        self._scored_batches += 1
        self._scored_positions += int(scored)
        last = self._scored_batches == SCORED_CHECK_BATCHES or int(self.global_step) + 1 >= self.total_steps
        if last and self._scored_positions == 0:
            raise NothingScoredError(nothing_scored_message(
                self._scored_batches, int(self.global_step), getattr(self.objective, "unscored_reason", None)))
        if last:
            self._scored_batches = SCORED_CHECK_BATCHES

    def _check_zero_loss(self, loss: torch.Tensor) -> None:
        """Stop after ``zero_loss_patience`` consecutive steps whose loss is exactly zero."""
        if not self.zero_loss_patience:
            return
        self._zero_steps = self._zero_steps + 1 if float(loss.detach()) == 0.0 else 0
        if self._zero_steps >= self.zero_loss_patience:
            reason = getattr(self.objective, "unscored_reason", None)
            raise ZeroLossError(
                f"the training loss was exactly 0.0 for {self._zero_steps} consecutive steps (up to step "
                f"{int(self.global_step)}){f': {reason}' if reason else ''}; nothing is being learned, so the run "
                "stops. Check the data's loss masks and the recipe's settings (run.zero_loss_patience=0 turns this "
                "check off)")

    def _last_checkpoint(self) -> str | None:
        """The newest checkpoint on disk of this run (written now or by the run this one resumed), if any."""
        trainer = self._trainer
        for callback in getattr(trainer, "checkpoint_callbacks", []) if trainer is not None else []:
            dirpath = getattr(callback, "dirpath", None)
            last = str(Path(dirpath) / "last.ckpt") if dirpath else ""  # a resumed run's checkpoint before any save
            for path in (getattr(callback, "last_model_path", ""), last, getattr(callback, "best_model_path", "")):
                if path and Path(path).is_file():
                    return str(path)
        return None

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        # Validation also asks for the target's logits so objectives can report agreement with its greedy tokens.
        loss, metrics = self._step(batch, with_logits=True)
        size = batch["input_ids"].shape[0]
        self.log("val/loss", loss, prog_bar=True, batch_size=size, sync_dist=True)
        self.log_dict({f"val/{k}": v for k, v in metrics.items()}, batch_size=size, sync_dist=True)

    def on_validation_start(self) -> None:
        """A ``trainer.validate`` after ``fit`` under DeepSpeed ZeRO-3 (seen on an H100) gets the drafter back with
        its buffers (the frozen target embedding) and its unpartitioned parameters still on the CPU, where fit's
        teardown (``lightning_module.cpu()``) left them. ZeRO-3 gathers partitioned parameters onto the GPU itself,
        but the small ones it keeps whole (``ds_persist``: norm weights, below its persistence threshold) and the
        buffers nothing moves back. Put those on the device the batches are on (other parameters are the strategy's)."""
        device = self.trainer.strategy.root_device
        for module in self.drafter.modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.device != device:
                    setattr(module, name, buffer.to(device))
            for param in module.parameters(recurse=False):
                # Only ZeRO-3's whole parameters: a partitioned one holds a placeholder ZeRO-3 fills, and a parameter
                # on the CPU under another strategy (FSDP's cpu_offload) is there on purpose.
                if getattr(param, "ds_persist", False) and param.device != device:
                    move_parameter(param, device)

    def on_validation_epoch_start(self) -> None:
        self.objective.on_validation_start()  # e.g. reset the per-head accuracy counts a calibrated tree is built from

    def on_validation_epoch_end(self) -> None:
        self.objective.on_validation_end(self._reduce_sum if self.trainer.world_size > 1 else None)
        self._probe_served()

    def _probe_served(self) -> None:
        """Served tau of the current weights (rank 0), every ``served_probe.every``-th validation pass and at a final
        ``trainer.validate``; logged as ``val/served_tau`` beside the training-side accuracy."""
        if self.served_probe is None or self.trainer.sanity_checking:
            return
        self._validations += 1
        final = self.trainer.state.fn == "validate"  # the trainer's last pass on the weights that are exported
        if not (final or self._validations % max(1, int(getattr(self.served_probe, "every", 1))) == 0):
            return
        if not self.trainer.is_global_zero:
            return
        record = self.served_record()
        if record is not None:
            self.served_validation = record
        if record is not None and record["served_tau"] is not None:
            self.log("val/served_tau", float(record["served_tau"]), rank_zero_only=True)

    def served_record(self) -> dict[str, Any] | None:
        """Export the current weights into a temporary folder and run :attr:`served_probe` on it: its record plus
        the step, or None when the probe serves nothing for this method."""
        import tempfile

        from draftsmith.distill.engine.exporting import export_from_module

        if callable(getattr(self.objective, "write_export", None)):  # an objective that makes a target, not a drafter
            return None
        method = str(self.objective.export_config().get("method", ""))
        serves = getattr(self.served_probe, "serves", None)
        if callable(serves) and not serves(method):
            return None
        step = int(self.global_step)
        rng, threads = torch.random.get_rng_state(), torch.get_num_threads()  # training resumes exactly as it was
        try:
            with tempfile.TemporaryDirectory(prefix="draftsmith-served-") as tmp:
                out = export_from_module(self, Path(tmp) / "export", training={"steps": step, "served_probe": True})
                record = self.served_probe(out)
        except Exception as err:  # noqa: BLE001 - a failed probe is reported, it does not end a long training run
            log.warning("served-tau probe failed at step %d (%s: %s); training goes on", step, type(err).__name__, err)
            return {"served_tau": None, "error": f"{type(err).__name__}: {err}", "step": step}
        finally:
            torch.random.set_rng_state(rng)
            torch.set_num_threads(threads)
        return None if record is None else {**record, "step": step}

    def _reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over every process (counts gathered by objectives during validation)."""
        return self.trainer.strategy.reduce(tensor.to(self.device), reduce_op="sum").cpu()

    def configure_optimizers(self) -> dict[str, Any]:
        cfg = self.optim_cfg
        try:
            groups = optimizer_groups(self.objective, float(cfg["lr"]))
        except ValueError as err:
            raise ConfigError(str(err)) from None
        optimizer = torch.optim.AdamW(groups, lr=float(cfg["lr"]), weight_decay=float(cfg.get("weight_decay", 0.0)),
                                      betas=tuple(cfg.get("betas", (0.9, 0.999))), eps=float(cfg.get("eps", 1e-8)))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lr_lambda(str(cfg.get("scheduler", "cosine")), int(cfg.get("warmup_steps", 0)), self.total_steps,
                      decay_steps=int(cfg.get("decay_steps") or 0)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Everything `draftsmith export CHECKPOINT` needs, so exporting never has to reload the target.
        checkpoint["draftsmith"] = {"tokens_seen": self._tokens_seen, "export_config": self.objective.export_config(),
                                    **self.run_info}
        if self.served_validation is not None:  # `draftsmith export CHECKPOINT` keeps the last served tau
            checkpoint["draftsmith"]["validation"] = self.served_validation

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._tokens_seen = int(checkpoint.get("draftsmith", {}).get("tokens_seen", 0))
        self.served_validation = checkpoint.get("draftsmith", {}).get("validation", self.served_validation)
