"""Learn2PD recipe: the filter (controllers/learn2pd.py) trained with BCE on oracle trajectories of
a diffusion target.

``python train.py recipe=learn2pd target=DIFFUSION_FOLDER data=TRAJECTORY_DIR``. The block length,
steps and generation settings come from the trajectory folder's ``meta.json``; the export records
them with the threshold.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from draftsmith.common.diffusion_format import DiffusionTargetError, spec_of
from draftsmith.common.errors import ConfigError, DataError
from draftsmith.controllers.learn2pd import Learn2PDConfig, Learn2PDFilter
from draftsmith.distill.data.trajectories import read_trajectories
from draftsmith.distill.engine.objective import Objective
from draftsmith.distill.target.frozen import FeatureTaps, Target
from draftsmith.recipes.learn2pd import Learn2PD


class Learn2PDObjective(Objective):
    """BCE of the filter's logits against the oracle's "prediction already equals the reference"
    labels."""

    batch_kind = "trajectories"
    taps = FeatureTaps(final_hidden=False)

    def __init__(self, module: Learn2PDFilter, inference: dict[str, Any]) -> None:
        self.module = module
        self.inference = inference

    def features(self, target: Any, batch: dict[str, torch.Tensor]) -> None:
        return None  # the filter reads recorded confidences, never the target

    def loss(
        self, batch: dict[str, torch.Tensor], feats: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean BCE over slots; metrics at the export threshold: false-positive rate (accepted but
        not yet final, over not-final slots), precision of acceptances, acceptance rate."""
        logits = self.module(batch["conf"])  # [B, L]
        labels = batch["labels"].float()
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        with torch.no_grad():
            accept = torch.sigmoid(logits) > self.module.config.threshold
            negatives, positives = (labels == 0), (labels == 1)
            metrics = {
                "fpr": (accept & negatives).sum() / negatives.sum().clamp(min=1),
                "precision": (accept & positives).sum() / accept.sum().clamp(min=1),
                "accept_rate": accept.float().mean(),
                "label_rate": labels.mean(),
            }
        return loss, metrics

    def export_config(self) -> dict[str, Any]:
        return {
            "method": "learn2pd",
            "architecture": self.module.architecture(),
            "inference": self.inference,
        }


def validate(cfg: Learn2PD) -> None:
    """Before the target loads: the trajectory folder reads (a broken one fails fast)."""
    read_trajectories(cfg.data.spec)


def build(cfg: Learn2PD, target: Target) -> Learn2PDObjective:
    """A filter as wide as the trajectories' blocks; the target must be the diffusion model that
    made them."""
    meta, _, _ = read_trajectories(cfg.data.spec)
    try:
        spec = spec_of(target.config, where=str(target.name_or_path))
    except DiffusionTargetError as err:
        raise ConfigError(str(err)) from None
    if spec.block_length != int(meta["block_length"]):
        raise DataError(
            f"the trajectories use blocks of {meta['block_length']} but target"
            f" {target.name_or_path} decodes blocks of {spec.block_length}; regenerate them with"
            " this target"
        )
    arch = Learn2PDConfig(
        block_length=spec.block_length,
        hidden=cfg.filter.hidden,
        num_layers=cfg.filter.num_layers,
        threshold=cfg.filter.threshold,
        steps_per_block=int(meta["steps_per_block"]),
    )
    inference = {
        "block_length": arch.block_length,
        "steps_per_block": arch.steps_per_block,
        "threshold": arch.threshold,
        "gen_length": int(meta["gen_length"]),
    }
    return Learn2PDObjective(Learn2PDFilter(arch), inference)
