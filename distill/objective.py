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
