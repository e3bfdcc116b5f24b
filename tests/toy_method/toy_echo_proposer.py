"""The toy method's runtime proposer: drafts one token (a chain of one) from the head, registered for the export
``method`` ``toy_echo``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.export.format import read_export
from draftsmith.runtime.drafting.base import Proposer, StepContext
from draftsmith.runtime.drafting.registry import register_proposer
from draftsmith.runtime.drafting.tree import DraftTree
from toy_method.toy_echo_head import ToyEchoHead

SERVES = ("toy_echo",)  # the export methods this family serves: runtime/drafting/registry.py reads this line


class ToyEchoProposer(Proposer):
    """The root plus the head's top-1 token."""

    max_tree_nodes = 2

    def __init__(self, head: ToyEchoHead) -> None:
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


@register_proposer("toy_echo")
def build_toy_echo(export_dir: str | Path, config: dict, target_model: Any, **_: Any) -> ToyEchoProposer:
    """The head from an export folder (``config`` is its config.json, already checked against the target)."""
    _, state = read_export(export_dir)
    head = ToyEchoHead(**config["architecture"])
    head.load_state_dict(state)
    return ToyEchoProposer(head.eval())
