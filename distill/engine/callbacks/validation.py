"""Validation-pass callbacks: the objective's own start / end hooks, then the served-tau probe on
the weights.

The probe is serving-faithful validation: at the end of every ``served_probe.every``-th validation
pass and of a final ``trainer.validate``, the current weights are exported to a temporary folder and
served by the runtime; its tau is logged as ``val/served_tau`` and kept in
``DistillModule.served_validation`` for the export (and for
:class:`~draftsmith.distill.engine.best_export.KeepBestServed`). The objective's end hook runs first
(it may calibrate what the export holds, e.g. Medusa's tree from per-head accuracy), so the two are
callbacks in that order.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

log = logging.getLogger(__name__)

# The seam for serving-faithful validation: export folder -> {"served_tau": float, ...}, or None
# when the runtime serves nothing for this method. Optional attributes: ``every`` (probe every N-th
# validation pass) and ``serves(method) -> bool`` (skip the temporary export for methods it would
# not serve).
ServedProbe = Callable[[Path], "dict[str, Any] | None"]


class ObjectiveValidationHooks(pl.Callback):
    """``objective.on_validation_start()`` / ``on_validation_end(reduce_sum)`` around each
    validation pass (``reduce_sum`` sums a tensor over processes under data parallelism, else
    None)."""

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        # e.g. reset the per-head accuracy counts of a calibrated tree
        pl_module.objective.on_validation_start()

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        def reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
            return trainer.strategy.reduce(tensor.to(pl_module.device), reduce_op="sum").cpu()

        pl_module.objective.on_validation_end(reduce_sum if trainer.world_size > 1 else None)


class ServedTauProbe(pl.Callback):
    """Serves the current weights with the module's ``served_probe`` (see the module docstring);
    rank 0 only."""

    def __init__(self) -> None:
        self.validations = 0  # validation passes seen, for the probe's ``every``

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        probe = getattr(pl_module, "served_probe", None)
        if probe is None or trainer.sanity_checking:
            return
        self.validations += 1
        # the trainer's last pass on the weights that are exported
        final = trainer.state.fn == "validate"
        if not (final or self.validations % max(1, int(getattr(probe, "every", 1))) == 0):
            return
        if not trainer.is_global_zero:
            return
        record = served_record(pl_module, probe)
        if record is not None:
            pl_module.served_validation = record
        if record is not None and record["served_tau"] is not None:
            pl_module.log("val/served_tau", float(record["served_tau"]), rank_zero_only=True)


def served_record(pl_module: Any, probe: ServedProbe) -> dict[str, Any] | None:
    """Export the current weights into a temporary folder and run ``probe`` on it: its record plus
    the step, or None when the probe serves nothing for this method. A failed probe is recorded;
    training goes on."""
    from draftsmith.distill.engine.exporting import export_from_module

    objective = pl_module.objective
    if callable(
        getattr(objective, "write_export", None)
    ):  # an objective that makes a target, not a drafter
        return None
    method = str(objective.export_config().get("method", ""))
    serves = getattr(probe, "serves", None)
    if callable(serves) and not serves(method):
        return None
    step = int(pl_module.global_step)
    rng, threads = (
        torch.random.get_rng_state(),
        torch.get_num_threads(),
    )  # training resumes exactly as it was
    try:
        with tempfile.TemporaryDirectory(prefix="draftsmith-served-") as tmp:
            out = export_from_module(
                pl_module, Path(tmp) / "export", training={"steps": step, "served_probe": True}
            )
            record = probe(out)
    # a failed probe is reported, it does not end a long training run
    except Exception as err:  # noqa: BLE001
        log.warning(
            "served-tau probe failed at step %d (%s: %s); training goes on",
            step,
            type(err).__name__,
            err,
        )
        return {"served_tau": None, "error": f"{type(err).__name__}: {err}", "step": step}
    finally:
        torch.random.set_rng_state(rng)
        torch.set_num_threads(threads)
    return None if record is None else {**record, "step": step}
