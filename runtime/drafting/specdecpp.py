"""SpecDec++ proposer: a chain drafter (the export's base) whose draft length is set by its trained
acceptance head.

A ``specdecpp`` export holds only the head and references the drafter export it was trained on
(``base_export``, checked by fingerprint: a head is refused with any other drafter). The builder
loads that base proposer in chain mode and wraps it: its default stop policy is
:class:`~draftsmith.runtime.acceptance.stop_policies.LearnedStop` with the head and the export's
threshold / depth bounds; a stop policy given by the loop (``--stop-policy``) wins, and a
``learned:H`` policy chosen without the export folder gets this head bound in
(:func:`~draftsmith.runtime.acceptance.stop_policies.bind_learned_head`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from draftsmith.common.constants import STOP_LEARNED
from draftsmith.controllers.acceptance import AcceptanceHead, base_export_dir
from draftsmith.runtime.acceptance.choice import parse_stop_policy
from draftsmith.runtime.acceptance.stop_policies import StopPolicy, bind_learned_head
from draftsmith.runtime.drafting.base import Proposer, ProposerWrapper, StepContext
from draftsmith.runtime.drafting.registry import build_proposer, chain_options, register_proposer
from draftsmith.runtime.drafting.tree import DraftTree
from draftsmith.runtime.target.interface import TargetDecoder


class LearnedStopProposer(ProposerWrapper):
    """Delegates every event to ``base`` (its taps, logits needs and target wrapper too); drafting
    uses ``default_policy`` unless the loop passes its own."""

    def __init__(self, base: Proposer, head: torch.nn.Module, default_policy: StopPolicy) -> None:
        super().__init__(base)
        self.base, self.head, self.default_policy = base, head, default_policy

    def propose(self, ctx: StepContext) -> DraftTree:
        """The base's chain, stopped by the learned rule (or the loop's policy)."""
        policy = (
            self.default_policy
            if ctx.stop_policy is None
            else bind_learned_head(ctx.stop_policy, self.head)
        )
        return self.base.propose(replace(ctx, stop_policy=policy))


@register_proposer("specdecpp")
def _build_specdecpp(
    export_dir: str | Path,
    config: dict,
    target_model: TargetDecoder,
    base_export: str | Path | None = None,
    **options: Any,
) -> LearnedStopProposer:
    """The base export's proposer in chain mode with the learned stop rule; ``base_export``
    overrides the recorded location of the drafter export (it must still be the one the head was
    trained on)."""
    head, head_config = AcceptanceHead.from_export(export_dir, base_dir=base_export)
    base = base_export_dir(head_config)
    place = target_model.lm_head_weight
    head = head.to(device=place.device).eval()
    policy = parse_stop_policy(
        (config.get("inference") or {}).get("stop_policy")
        or {"kind": STOP_LEARNED, "threshold": 0.3},
        head,
    )
    options = {
        **chain_options(base, policy.max_depth),
        **options,
    }  # the chain may reach the rule's max depth
    return LearnedStopProposer(build_proposer(base, target_model, **options), head, policy)
