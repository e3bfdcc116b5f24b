"""The fused LM-head loss of a recipe's ``loss`` group, shared by the recipes whose heads score a
vocabulary (recipes without the group train with
:class:`~draftsmith.distill.losses.core.LMHeadLoss`'s defaults, the same values).
"""

from __future__ import annotations

import dataclasses

from draftsmith.distill.config.schema import LossConfig
from draftsmith.distill.losses.core import LMHeadLoss


def lm_head_loss(loss: LossConfig) -> LMHeadLoss:
    """``loss`` as the fused loss (distill/losses/core.py reads the group); ``replay_weight`` where
    the group declares it (EAGLE-3, whose TTT chain is the served chain)."""
    block = dataclasses.asdict(loss)
    return LMHeadLoss.from_config({"loss": block}, replay="replay_weight" in block)
