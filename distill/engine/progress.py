"""A step-based training progress bar: ``step 120/200``, tokens/s and the time left.

Lightning's default bar counts batches of the current epoch (``Epoch 0/-2 ... 60/60``), which says
nothing about a run bounded by ``trainer.max_steps``. This one counts optimizer steps against
``max_steps`` and adds the training throughput (non-padding tokens per second, all processes) and an
ETA from the pace since this fit started (so a resumed run does not count the steps it restored as
instant).
"""

from __future__ import annotations

import time
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Timer, TQDMProgressBar

from draftsmith.common.durations import format_duration


def progress_fields(
    step: int,
    max_steps: int,
    start_step: int,
    tokens: int,
    seconds: float,
    time_left: float | None = None,
) -> dict[str, str]:
    """The bar's text for ``step`` of ``max_steps``: ``{"step": "N/M", "tok/s": ..., "eta": ...}``.

    ``start_step`` is where this fit began (a resume starts past 0), ``tokens`` the tokens trained
    on since then and ``seconds`` the wall time since then; before the first step of this fit there
    is no pace, so ``eta`` is ``?``. ``time_left`` is what ``trainer.max_time`` still allows: a
    time-bounded run ends at whichever comes first.
    """
    done = step - start_step
    fields = {"step": f"{step}/{max_steps}"}
    if done <= 0 or seconds <= 0:
        return {**fields, "tok/s": "?", "eta": "?"}
    left = max(0, max_steps - step) * seconds / done
    if time_left is not None:
        left = min(left, max(0.0, time_left))
    return {**fields, "tok/s": f"{tokens / seconds:,.0f}", "eta": format_duration(left)}


def max_time_left(trainer: pl.Trainer) -> float | None:
    """Seconds ``trainer.max_time`` still allows this fit (restored elapsed time counted), or None
    without one."""
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    left = timer.time_remaining("train") if timer is not None else None
    return float(left) if left is not None else None


class StepProgressBar(TQDMProgressBar):
    """TQDM bar over optimizer steps (``trainer.max_steps``) with tokens/s and ETA; validation bars
    are unchanged."""

    def __init__(self, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self._start_step = 0
        self._start_tokens = 0
        self._start_time = 0.0

    def init_train_tqdm(self) -> Any:
        """Lightning's train bar without tqdm's own rate and remaining time (they count restored
        steps of a resumed run as done in this run's time); the postfix carries tokens/s and the ETA
        instead."""
        bar = super().init_train_tqdm()
        bar.bar_format = "{desc} {percentage:3.0f}%|{bar}| [{elapsed}{postfix}]"
        return bar

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._start_step = int(trainer.global_step)
        self._start_tokens = int(getattr(pl_module, "tokens_seen", 0))
        self._start_time = time.perf_counter()

    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        # Lightning resets the bar to the epoch's batch count; a step-bounded run wants max_steps
        # and the step reached.
        self._count_steps(trainer)

    def _count_steps(self, trainer: pl.Trainer) -> None:
        """Make the bar count optimizer steps out of ``max_steps``, at the step reached."""
        bar = self.train_progress_bar
        bar.reset(total=int(trainer.max_steps))
        bar.initial = 0
        bar.n = int(trainer.global_step)
        bar.set_description(f"step {trainer.global_step}/{trainer.max_steps}")
        bar.refresh()

    def describe(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> tuple[str, dict[str, Any]]:
        """The description (``step N/M``) and postfix (tokens/s, ETA, then the logged progress-bar
        metrics)."""
        # tokens_seen counts this process only; data-parallel processes train on equal shares.
        tokens = (int(getattr(pl_module, "tokens_seen", 0)) - self._start_tokens) * int(
            trainer.world_size or 1
        )
        fields = progress_fields(
            int(trainer.global_step),
            int(trainer.max_steps),
            self._start_step,
            tokens,
            time.perf_counter() - self._start_time,
            time_left=max_time_left(trainer),
        )
        metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        loss = getattr(
            pl_module, "last_logged_loss", None
        )  # read on log steps: the bar never reads the device
        if loss is not None:
            metrics = {"loss": f"{loss:.4g}", **metrics}
        return f"step {fields['step']}", {"tok/s": fields["tok/s"], "eta": fields["eta"], **metrics}

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        bar = self.train_progress_bar
        step = int(trainer.global_step)
        if bar is None or not self._should_update(step, int(trainer.max_steps)):
            return
        if bar.total != int(
            trainer.max_steps
        ):  # a run resumed mid-epoch gets no epoch start: its bar read 0%
            self._count_steps(trainer)
        description, postfix = self.describe(trainer, pl_module)
        bar.n = step
        bar.set_description(description, refresh=False)
        bar.set_postfix(postfix)  # refreshes the line

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.train_progress_bar.disable:
            description, postfix = self.describe(trainer, pl_module)
            self.train_progress_bar.set_description(description, refresh=False)
            self.train_progress_bar.set_postfix(postfix)
        if self._leave:
            self.train_progress_bar.close()
