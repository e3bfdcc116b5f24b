"""The toy method's runtime proposer: drafts one token (a chain of one) from the head, registered
for the export ``method`` ``toy``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.export.format import read_export
from draftsmith.heads.toy import ToyHead
from draftsmith.runtime.drafting.base import Proposer, StepContext
from draftsmith.runtime.drafting.registry import register_proposer
from draftsmith.runtime.drafting.tree import DraftTree


class ToyProposer(Proposer):
    """The root plus the head's top-1 token."""

    max_tree_nodes = 2

    def __init__(self, head: ToyHead) -> None:
        self.head = head

    def begin(self, ctx: StepContext) -> None:
        """Stateless."""

    @torch.no_grad()
    def propose(self, ctx: StepContext) -> DraftTree:
        """Root, then argmax head(hidden of the root's predecessor)."""
        token = int(self.head(ctx.hidden.to(self.head.proj.weight.dtype)).argmax(-1))
        return DraftTree.chain([ctx.root_token, token])

    def accept(self, ctx: StepContext) -> None:
        """Nothing to learn."""


@register_proposer("toy")
def build_toy(export_dir: str | Path, config: dict, target_model: Any, **_: Any) -> ToyProposer:
    """The head from an export folder (``config`` is its config.json, already checked against the
    target)."""
    _, state = read_export(export_dir)
    head = ToyHead(**config["architecture"])
    head.load_state_dict(state)
    return ToyProposer(head.eval())
