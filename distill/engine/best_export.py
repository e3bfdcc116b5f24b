"""Keep the export that served best on held-out prompts, not the last one.

Training loss keeps falling after held-out acceptance has peaked (EAGLE-3 overfits after ~5 epochs
of a small set), so the weights worth serving are chosen by the serving-faithful probe
(``val/served_tau``, see ``DistillModule.served_probe``). Each time a probe measures a served tau
above every earlier one, this callback exports the current weights into ``<run dir>/export_best``
(atomically, beside the final ``export``). That export's own config.json is the record a resumed run
compares against: a checkpoint is written before the validation pass of its step, so it cannot hold
the probe's verdict on those weights; a fresh run in the folder starts over.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from draftsmith.export.format import ExportError, read_config

BEST_EXPORT = "export_best"


class KeepBestServed(pl.Callback):
    """Export the weights whenever ``module.served_validation`` holds a new highest served tau
    measured now."""

    def __init__(self, run_dir: str | Path, resumed: bool) -> None:
        self.out, self.resumed = Path(run_dir) / BEST_EXPORT, resumed
        # {step, served_tau, tokens}
        self.best: dict[str, Any] | None = kept_best(self.out) if resumed else None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a fresh run: an earlier run's best is not this one's
        if not self.resumed and trainer.is_global_zero:
            shutil.rmtree(self.out, ignore_errors=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = getattr(pl_module, "served_validation", None)
        if not trainer.is_global_zero or trainer.sanity_checking or record is None:
            return
        tau, step = record.get("served_tau"), int(trainer.global_step)
        if tau is None or int(record.get("step", -1)) != step:  # no probe ran on these weights
            return
        if self.best is not None and float(tau) <= self.best["served_tau"]:
            # ties keep the earlier (cheaper to reach) weights, and the final pass re-probing them
            # changes none
            return
        from draftsmith.distill.engine.exporting import export_from_module

        best = {
            "step": step,
            "served_tau": float(tau),
            "tokens": int(getattr(pl_module, "tokens_seen", 0)),
        }
        training = {
            "steps": step,
            "tokens": best["tokens"],
            "served_tau": best["served_tau"],
            "chosen_by": "val/served_tau",
        }
        export_from_module(pl_module, self.out, training=training)
        self.best = best


def kept_best(export_dir: Path) -> dict[str, Any] | None:
    """``{"step", "served_tau", "tokens"}`` of a best-served export written by
    :class:`KeepBestServed`, else None."""
    try:
        training = read_config(export_dir)["training"]
    except (ExportError, KeyError):
        return None
    if training.get("chosen_by") != "val/served_tau":
        return None
    return {
        "step": int(training["steps"]),
        "served_tau": float(training["served_tau"]),
        "tokens": int(training["tokens"]),
    }
