"""The toy method's objective (CE of the head against the token at t+2) and its build."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from draftsmith.distill.engine.objective import Objective
from draftsmith.distill.target.frozen import FeatureTaps, Target, TargetFeatures
from draftsmith.heads.toy import ToyHead
from draftsmith.recipes.toy import Toy


class ToyObjective(Objective):
    """CE of the head at position t against the token at t+2, on assistant tokens."""

    def __init__(self, head: ToyHead) -> None:
        self.module = head
        self.taps = FeatureTaps(
            final_hidden=True
        )  # the target's post-norm hidden state, nothing else

    def loss(
        self, batch: dict[str, torch.Tensor], feats: TargetFeatures
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Masked CE of head(h_t) vs x_{t+2}, plus its top-1 accuracy as a metric."""
        hidden = feats.final_hidden[:, :-2].to(self.module.proj.weight.dtype)  # [B, T-2, H]
        keep = (batch["loss_mask"] * batch["attention_mask"])[:, 2:].bool()  # [B, T-2]
        logits = self.module(hidden[keep])  # [N, V]
        labels = batch["input_ids"][:, 2:][keep]  # [N]
        loss = F.cross_entropy(logits.float(), labels)
        return loss, {"top1": (logits.argmax(-1) == labels).float().mean().detach()}

    def export_config(self) -> dict[str, Any]:
        """The export's ``method`` (the key its runtime proposer is registered for), architecture
        and inference."""
        return {
            "method": "toy",
            "architecture": self.module.architecture(),
            "inference": {"verifier": "greedy"},
        }


def build(cfg: Toy, target: Target) -> ToyObjective:
    """A head sized from the target; ``cfg`` is the typed config (``cfg.head.bias`` a bool)."""
    return ToyObjective(ToyHead(target.hidden_size, target.vocab_size, cfg.head.bias))
