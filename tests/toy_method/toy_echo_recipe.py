"""The toy method's recipe: ``build(cfg, target) -> Objective`` registered as ``toy_echo``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from draftsmith.common.errors import ConfigError
from draftsmith.distill.engine.objective import Objective
from draftsmith.distill.target.frozen import FeatureTaps, Target, TargetFeatures
from draftsmith.recipes.registry import register_recipe
from toy_method.toy_echo_head import ToyEchoHead

METHOD = "toy_echo"


class ToyEchoObjective(Objective):
    """CE of the head at position t against the token at t+2, on assistant tokens."""

    def __init__(self, head: ToyEchoHead) -> None:
        self.module = head
        self.taps = FeatureTaps(final_hidden=True)  # the target's post-norm hidden state, nothing else

    def loss(self, batch: dict[str, torch.Tensor],
             feats: TargetFeatures) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Masked CE of head(h_t) vs x_{t+2}, plus its top-1 accuracy as a metric."""
        hidden = feats.final_hidden[:, :-2].to(self.module.proj.weight.dtype)  # [B, T-2, H]
        keep = (batch["loss_mask"] * batch["attention_mask"])[:, 2:].bool()  # [B, T-2]
        logits = self.module(hidden[keep])  # [N, V]
        labels = batch["input_ids"][:, 2:][keep]  # [N]
        loss = F.cross_entropy(logits.float(), labels)
        return loss, {"top1": (logits.argmax(-1) == labels).float().mean().detach()}

    def export_config(self) -> dict[str, Any]:
        """The export's ``method`` (the key its runtime proposer is registered for), architecture and inference."""
        return {"method": METHOD, "architecture": self.module.architecture(), "inference": {"verifier": "greedy"}}


def validate(cfg: Any) -> None:
    """Config checks that must fail before the target loads."""
    if cfg.recipe.name != METHOD:
        raise ConfigError(f"recipe.name={cfg.recipe.name!r}; this recipe is {METHOD!r}")


@register_recipe(METHOD, validate=validate)
def build(cfg: Any, target: Target) -> ToyEchoObjective:
    """A head sized from the target."""
    return ToyEchoObjective(ToyEchoHead(target.hidden_size, target.vocab_size))
