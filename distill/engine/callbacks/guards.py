"""Training guards that read nothing back inside a step: a non-finite loss, first batches that score
nothing, a loss stuck at exactly zero.

Reading a device value (``bool(torch.isfinite(loss))``, ``float(loss)``, ``int(scored)``) makes the
host wait for the GPU, so a step that does it every time cannot run ahead. Here each step only
updates small tensors on the device (the first non-finite step and its value, the current run of
zero losses and the step it reached the patience, the scored count of the first batches); they are
read on log steps (``trainer.log_every_n_steps``), before any checkpoint is written
(``on_save_checkpoint``: a checkpoint never holds weights after a non-finite loss) and at the end of
training. A fault is therefore reported with its exact step, at most one log interval after it
happened.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from draftsmith.common.errors import DraftsmithError

SCORED_CHECK_BATCHES = 4  # the first batches of a run that must score some position between them


class NonFiniteLossError(DraftsmithError, RuntimeError):
    """The training loss became NaN or inf; the run stops (any checkpoint written before stays
    intact)."""


class NothingScoredError(DraftsmithError, RuntimeError):
    """The first training batches score no position at all: the run would train on a zero loss and
    export noise."""


class ZeroLossError(DraftsmithError, RuntimeError):
    """The training loss was exactly zero for ``run.zero_loss_patience`` consecutive steps: nothing
    is learned."""


def nothing_scored_message(batches: int, step: int, reason: str | None) -> str:
    """What to tell the user when the first ``batches`` batches scored nothing (``reason``: the
    objective's why)."""
    why = reason or (
        "their loss masks select no token: no assistant reply survives data.max_length, or the chat"
        " template marks no assistant turn"
    )
    return (
        f"nothing to train on: the first {batches} training batch(es) score no position ({why});"
        f" stopping at step {step} instead of training on a zero loss"
    )


def nonfinite_message(loss: float, step: int, checkpoint: str | None) -> str:
    """What to tell the user when the loss is ``loss`` at ``step``: where the last good checkpoint
    is, or that none was written yet, and what to try."""
    if checkpoint:
        where = f"The last good checkpoint is intact: {checkpoint}."
    else:
        where = (
            "No checkpoint was written yet (the first comes after run.checkpoint_every steps), so a"
            " re-run starts from scratch."
        )
    return (
        f"loss is {loss} at step {step}; stopping. {where} Lower optim.lr, check the data, or use"
        " fp32 (target.dtype=fp32)."
    )


def zero_loss_message(patience: int, step: int, reason: str | None) -> str:
    """What to tell the user when the loss was exactly zero for ``patience`` steps up to
    ``step``."""
    return (
        f"the training loss was exactly 0.0 for {patience} consecutive steps (up to step"
        f" {step}){f': {reason}' if reason else ''}; nothing is being learned, so the run stops."
        " Check the data's loss masks and the recipe's settings (run.zero_loss_patience=0 turns"
        " this check off)"
    )


def last_checkpoint(trainer: Any) -> str | None:
    """The newest checkpoint on disk of this run (written now or by the run this one resumed), if
    any."""
    for callback in getattr(trainer, "checkpoint_callbacks", []) if trainer is not None else []:
        dirpath = getattr(callback, "dirpath", None)
        # a resumed run's checkpoint before any save
        last = str(Path(dirpath) / "last.ckpt") if dirpath else ""
        for path in (
            getattr(callback, "last_model_path", ""),
            last,
            getattr(callback, "best_model_path", ""),
        ):
            if path and Path(path).is_file():
                return str(path)
    return None


class GuardState:
    """The guards' device-side record of the steps so far; :meth:`observe` never reads a value
    back."""

    def __init__(self, zero_loss_patience: int = 5) -> None:
        self.patience = int(zero_loss_patience or 0)  # 0 = never stop on a zero loss
        self.batches = 0  # batches observed among the first SCORED_CHECK_BATCHES (a host count)
        self.scored_confirmed = False
        self._tensors: dict[str, torch.Tensor] | None = None

    def _state(self, like: torch.Tensor) -> dict[str, torch.Tensor]:
        if self._tensors is None or self._tensors["bad_step"].device != like.device:
            long = {"dtype": torch.long, "device": like.device}
            self._tensors = {
                "bad_step": torch.full((), -1, **long),
                "bad_value": torch.zeros((), device=like.device),
                "zero_run": torch.zeros((), **long),
                "zero_step": torch.full((), -1, **long),
                "scored": torch.zeros((), device=like.device),
            }
        return self._tensors

    def observe(self, step: int, loss: torch.Tensor, scored: torch.Tensor | int | None) -> None:
        """Fold one training step's loss and scored count into the record (tensor ops only)."""
        state = self._state(loss)
        loss = loss.detach().float()
        bad = ~torch.isfinite(loss) & (state["bad_step"] < 0)  # the first non-finite step wins
        state["bad_step"] = torch.where(bad, step, state["bad_step"])
        state["bad_value"] = torch.where(bad, loss, state["bad_value"])
        state["zero_run"] = (state["zero_run"] + 1) * (loss == 0)
        reached = (
            (state["zero_run"] >= max(self.patience, 1))
            & (state["zero_step"] < 0)
            & bool(self.patience)
        )
        state["zero_step"] = torch.where(reached, step, state["zero_step"])
        if self.batches < SCORED_CHECK_BATCHES and scored is not None:
            state["scored"] = state["scored"] + scored
            self.batches += 1

    def check(
        self, trainer: Any, step: int, last: bool, reason: Callable[[], str | None] = lambda: None
    ) -> None:
        """Read the record (one device read-back) and raise the first fault it holds; ``last``: the
        run ends now, so a scored check still open is decided on the batches seen; ``reason()``: why
        nothing was scored, if known.
        """
        if self._tensors is None:
            return
        state = self._tensors
        values = torch.stack(
            [
                state["bad_step"].float(),
                state["bad_value"],
                state["zero_step"].float(),
                state["scored"],
            ]
        ).tolist()  # one read for the whole record
        bad_step, bad_value, zero_step, scored = (
            int(values[0]),
            values[1],
            int(values[2]),
            values[3],
        )
        if bad_step >= 0:
            raise NonFiniteLossError(
                nonfinite_message(bad_value, bad_step, last_checkpoint(trainer))
            )
        decided = self.batches >= SCORED_CHECK_BATCHES or last
        if not self.scored_confirmed and decided and self.batches:
            if scored == 0:
                raise NothingScoredError(nothing_scored_message(self.batches, step, reason()))
            self.scored_confirmed = True
        if zero_step >= 0:
            raise ZeroLossError(zero_loss_message(self.patience, zero_step, reason()))


class TrainingGuards(pl.Callback):
    """Stops a run on a non-finite loss, on first batches that score nothing and on a loss stuck at
    zero, reading the device record only on log steps, before checkpoints and at the end (module
    docstring)."""

    def __init__(self, state: GuardState) -> None:
        self.state = state

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = int(trainer.global_step) - 1  # the optimizer step just taken
        last = step + 1 >= int(trainer.max_steps) > 0
        if last or is_log_step(trainer, step):
            self.state.check(trainer, step, last, unscored_reason(pl_module))

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: Any, checkpoint: dict[str, Any]
    ) -> None:
        self.state.check(trainer, int(trainer.global_step) - 1, False, unscored_reason(pl_module))

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.state.check(trainer, int(trainer.global_step) - 1, True, unscored_reason(pl_module))


def unscored_reason(pl_module: Any) -> Callable[[], str | None]:
    """The objective's explanation of a batch that scored nothing, read only when a message needs
    it."""
    return lambda: getattr(getattr(pl_module, "objective", None), "unscored_reason", None)


def is_log_step(trainer: Any, step: int) -> bool:
    """Whether optimizer step ``step`` (0-based) is one Lightning logs at (``(step + 1) %
    log_every_n_steps == 0``)."""
    every = int(getattr(trainer, "log_every_n_steps", 0) or 0)
    return every > 0 and (step + 1) % every == 0
