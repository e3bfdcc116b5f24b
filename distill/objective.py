"""The contract between a recipe and the one LightningModule: what to train, what to tap, how to score it."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from draftsmith.distill.target import FeatureTaps, TargetFeatures


class Objective(Protocol):
    """A method's training objective, built by ``recipes/<method>.py:build``.

    ``module`` holds every trainable parameter (and nothing of the frozen target); it is what checkpoints and
    exports save. ``loss`` receives the batch (``input_ids``, ``attention_mask``, ``loss_mask`` [B, T]) and the
    target features requested by ``taps``, and returns the scalar loss plus detached metrics to log.
    """

    module: nn.Module
    taps: FeatureTaps

    def loss(self, batch: dict[str, torch.Tensor], feats: TargetFeatures) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ...

    def export_config(self) -> dict[str, Any]:
        """``method``, ``architecture`` and ``inference`` blocks of the export config (target is added by the caller)."""
        ...


# Optional hooks an objective may define (DistillModule reads them with the helpers below; absent = default):
#   batch_kind: str                       the datamodule it trains on ("chat" default; rollouts, trajectories and
#                                         preference pairs register their own in distill.datamodule)
#   frozen: dict[str, nn.Module]          extra frozen models (a reference policy, a base drafter): moved with the
#                                         target, never optimised, never saved
#   param_groups() -> list[dict]          optimizer groups over ``module``'s parameters, each {"params", "lr"} or
#                                         {"params", "lr_scale"} (x optim.lr), e.g. heads vs adapter learning rates
#   features(target, batch) -> Any        its own feature computation (several forwards, a layer range, ...);
#                                         replaces ``target.features(input_ids, attention_mask, taps)``
#   set_step(global_step)                 called before each training step (warmups that survive a resume)
#   on_validation_start() / on_validation_end(reduce_sum)
#                                         wrap each validation pass (e.g. Medusa tree calibration from head
#                                         accuracies, summed over processes with ``reduce_sum``)


def batch_kind(objective: Any) -> str:
    """The datamodule kind ``objective`` trains on (default "chat")."""
    return str(getattr(objective, "batch_kind", "chat"))


def frozen_models(objective: Any) -> dict[str, nn.Module]:
    """The extra frozen models ``objective`` declares (default none)."""
    return dict(getattr(objective, "frozen", None) or {})


def optimizer_groups(objective: Any, base_lr: float) -> list[dict[str, Any]]:
    """Optimizer parameter groups: the objective's ``param_groups()`` (``lr_scale`` resolved against ``base_lr``) or
    one group of every trainable parameter of ``objective.module``. Raises ValueError when a group holds a parameter
    that is frozen or not part of ``module`` (the optimizer must see trainable drafter parameters only)."""
    trainable = {id(p) for p in objective.module.parameters() if p.requires_grad}
    if not callable(getattr(objective, "param_groups", None)):
        return [{"params": [p for p in objective.module.parameters() if p.requires_grad], "lr": base_lr}]
    groups, seen = [], set()
    for i, group in enumerate(objective.param_groups()):
        group = dict(group)
        params = list(group.pop("params"))
        stray = [p for p in params if id(p) not in trainable]
        if stray or any(id(p) in seen for p in params):
            raise ValueError(f"param group {i} holds {'frozen or foreign' if stray else 'repeated'} parameters; "
                             "groups must split the trainable parameters of the objective's module")
        seen.update(id(p) for p in params)
        lr = group.pop("lr", None)
        groups.append({"params": params, "lr": base_lr * float(group.pop("lr_scale", 1.0)) if lr is None else lr,
                       **group})
    missing = trainable - seen
    if missing:
        raise ValueError(f"{len(missing)} trainable parameters are in no param group; add them to one")
    return groups
