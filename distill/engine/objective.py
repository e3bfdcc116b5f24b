"""The contract between a recipe and the one LightningModule: what to train, what to tap, how to
score it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import nn

from draftsmith.distill.target.frozen import FeatureTaps


class Objective:
    """A method's training objective, built by ``recipes/<method>.py:build``; every recipe's
    objective subclasses it.

    ``module`` holds every trainable parameter (and nothing of the frozen target); it is what
    checkpoints and exports save. ``loss`` receives the batch (``input_ids``, ``attention_mask``,
    ``loss_mask`` [B, T]) and the target features requested by ``taps``, and returns the scalar loss
    plus detached metrics to log.

    The other members are hooks with defaults that
    :class:`~draftsmith.distill.engine.module.DistillModule` calls directly: ``batch_kind`` (the
    datamodule kind; rollouts, trajectories and preference pairs register their own in
    distill.datamodule), ``frozen`` (extra frozen models, e.g. a reference policy or a base drafter:
    moved with the target, never optimised, never saved), :meth:`param_groups`, :meth:`features`
    (when overridden it replaces ``target.features(input_ids, attention_mask, taps)``),
    :meth:`set_step` and the validation hooks.
    """

    module: nn.Module
    taps: FeatureTaps
    batch_kind: ClassVar[str] = "chat"
    frozen: Mapping[str, nn.Module] = MappingProxyType({})
    # Set by ``loss`` where a batch's scored positions are not simply its loss mask (EAGLE-3 scores
    # only those whose target argmax is in the draft vocabulary): how many the last batch scored
    # and, when none, why. The module stops a run whose first batches score nothing; None = count
    # the batch's loss mask.
    last_scored: int | None = None
    unscored_reason: str | None = None

    def loss(
        self, batch: dict[str, torch.Tensor], feats: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(scalar loss, detached metrics) of ``batch`` given the target features ``feats``."""
        raise NotImplementedError

    def export_config(self) -> dict[str, Any]:
        """``method``, ``architecture`` and ``inference`` blocks of the export config (target is
        added by the caller)."""
        raise NotImplementedError

    def param_groups(self) -> list[dict[str, Any]]:
        """Optimizer groups over ``module``'s parameters, each {"params", "lr"} or {"params",
        "lr_scale"} (x optim.lr), e.g. heads vs adapter learning rates. Default: one group of every
        trainable parameter."""
        return [{"params": [p for p in self.module.parameters() if p.requires_grad]}]

    def features(self, target: Any, batch: dict[str, torch.Tensor]) -> Any:
        """The target features of ``batch``; override for own forwards (several, a layer range,
        ...)."""
        return target.features(batch["input_ids"], batch["attention_mask"], self.taps)

    @property
    def own_features(self) -> bool:
        """Whether this objective computes its own features (it then cannot train from a feature
        cache)."""
        return type(self).features is not Objective.features

    def set_step(self, step: int) -> None:
        """Called with the global step before each training step (warmups that survive a resume)."""

    def on_validation_start(self) -> None:
        """Called before each validation pass (e.g. reset the head accuracy counts of a calibrated
        tree)."""

    def on_validation_end(
        self, reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        """Called after each validation pass; ``reduce_sum`` sums a tensor over processes (None on
        one process)."""


class CalibratedObjective(Objective):
    """An objective whose tree is calibrated on held-out batches: ``self.calibration`` (a
    :class:`~draftsmith.common.trees.TreeCalibration`) counts head accuracies over each validation
    pass.
    """

    calibration: Any

    def on_validation_start(self) -> None:
        self.calibration.on_validation_start()

    def on_validation_end(
        self, reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        self.calibration.on_validation_end(reduce_sum)


def has_own_features(objective: Any) -> bool:
    """Whether ``objective`` computes its own features (an :class:`Objective` that overrides
    ``features``)."""
    if isinstance(objective, Objective):
        return objective.own_features
    return callable(getattr(objective, "features", None))


def batch_kind(objective: Any) -> str:
    """The datamodule kind ``objective`` trains on (default "chat")."""
    return str(getattr(objective, "batch_kind", "chat"))


def frozen_models(objective: Any) -> dict[str, nn.Module]:
    """The extra frozen models ``objective`` declares (default none)."""
    return dict(getattr(objective, "frozen", None) or {})


def optimizer_groups(objective: Any, base_lr: float) -> list[dict[str, Any]]:
    """Optimizer parameter groups: the objective's ``param_groups()`` (``lr_scale`` resolved against
    ``base_lr``) or one group of every trainable parameter of ``objective.module``. Raises
    ValueError when a group holds a parameter that is frozen or not part of ``module`` (the
    optimizer must see trainable drafter parameters only).
    """
    trainable = {id(p) for p in objective.module.parameters() if p.requires_grad}
    if not isinstance(objective, Objective) and not callable(
        getattr(objective, "param_groups", None)
    ):
        return [
            {"params": [p for p in objective.module.parameters() if p.requires_grad], "lr": base_lr}
        ]
    groups, seen = [], set()
    for i, group in enumerate(objective.param_groups()):
        group = dict(group)
        params = list(group.pop("params"))
        stray = [p for p in params if id(p) not in trainable]
        if stray or any(id(p) in seen for p in params):
            raise ValueError(
                f"param group {i} holds {'frozen or foreign' if stray else 'repeated'} parameters; "
                "groups must split the trainable parameters of the objective's module"
            )
        seen.update(id(p) for p in params)
        lr = group.pop("lr", None)
        groups.append(
            {
                "params": params,
                "lr": base_lr * float(group.pop("lr_scale", 1.0)) if lr is None else lr,
                **group,
            }
        )
    missing = trainable - seen
    if missing:
        raise ValueError(
            f"{len(missing)} trainable parameters are in no param group; add them to one"
        )
    return groups
