"""Medusa heads as a proposer: a static sparse tree of the heads' top-k tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.common.errors import InputError
from draftsmith.runtime.acceptance.stop_policies import StopContext
from draftsmith.runtime.drafting.base import LookaheadHeads, StepContext, prune_tree
from draftsmith.runtime.drafting.registry import register_proposer
from draftsmith.runtime.drafting.tree import DraftTree, StaticTree
from draftsmith.runtime.target.interface import TargetDecoder


class MedusaProposer(LookaheadHeads):
    """Medusa heads on the target's hidden state fill a static tree with each head's top-k tokens.

    ``heads``: an nn.Module mapping hidden [..., H] to logits [K, ..., V] (head k predicts the token
    k+2 after the hidden's position, i.e. k+1 after the root). Children are deterministic (point
    masses), which the rejection sampler handles exactly. A stop policy prunes the tree: a node's
    children are dropped when the policy says so for the node's :class:`StopContext` (its depth, its
    head probability, the target hidden).
    """

    # accept() never reads the target's logits: greedy verify may take argmaxes only
    reads_logits = False

    shape_family = "static_tree"  # runtime/shapes/draft_shapes.py: node budgets through reshape()
    counts_draft_calls = True  # one forward of every head per propose()

    def __init__(
        self, heads: nn.Module, tree: StaticTree | list[list[int]], top_k: int | None = None
    ) -> None:
        self.heads = heads
        self.reshape({"tree": tree, "top_k": top_k})
        arch = getattr(heads, "config", None)
        self.num_heads = getattr(arch, "num_heads", None) or self.tree.depth
        self.shape_vocab = getattr(arch, "draft_vocab_size", None) or getattr(
            arch, "vocab_size", None
        )

    def reshape(self, options: dict[str, Any]) -> None:
        """Draft another static tree from now on: ``tree`` (a StaticTree or choice paths) and
        ``top_k``."""
        tree, top_k = options["tree"], options.get("top_k")
        if not isinstance(tree, StaticTree):
            tree = StaticTree.from_paths(tree, top_k or 1 + max(c for p in tree for c in p))
        self.tree = tree
        self.max_tree_nodes = tree.num_nodes

    def begin(self, ctx: StepContext) -> None:
        """Medusa is stateless across steps."""

    @torch.no_grad()
    def propose(self, ctx: StepContext) -> DraftTree:
        """Run the heads on ``ctx.hidden`` [H] and fill the static tree."""
        logits = self.heads(ctx.hidden)  # [K, V]
        self.draft_calls += 1
        if logits.dim() != 2 or logits.shape[0] < self.tree.depth:
            raise ValueError(
                f"Medusa heads returned logits {tuple(logits.shape)}; the tree needs"
                f" {self.tree.depth} heads, each giving [V] for a hidden [H]"
            )
        top_p, top_i = torch.softmax(logits.float(), -1).topk(self.tree.top_k, dim=-1)  # [K, top_k]
        tree = self.tree.build(ctx.root_token, self._target_ids(top_i))
        conf = torch.cat([torch.ones(1, device=top_p.device), top_p.reshape(-1)])[
            self.tree.candidate_index.to(top_p.device)
        ]
        tree.draft_confidence = conf.cpu()  # [N]
        policy = ctx.stop_policy
        if policy is None:
            return tree
        keep = [True] * tree.num_nodes
        expand = [policy.max_depth > 0] + [False] * (
            tree.num_nodes - 1
        )  # may node i have children?
        stops = [
            StopContext(0, 1.0, ctx.hidden)
        ]  # one per node: each path keeps its own policy scratch
        for i in range(1, tree.num_nodes):
            parent = int(tree.parents[i])
            stops.append(stops[parent].child(int(tree.depths[i]), float(conf[i]), ctx.hidden))
            keep[i] = keep[parent] and expand[parent]
            if keep[i]:
                expand[i] = not policy.should_stop(stops[i])
        return tree if all(keep) else prune_tree(tree, keep)

    def _target_ids(self, head_ids: torch.Tensor) -> torch.Tensor:
        """Head logit columns -> target ids (heads with a draft vocabulary score only its
        tokens)."""
        to_target = getattr(self.heads, "to_target_ids", None)
        return to_target(head_ids) if to_target is not None else head_ids

    @torch.no_grad()
    def lookahead_top1(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> each head's top-1 target id [K, T] (head k at t predicts the token at
        t+k+2)."""
        return self._target_ids(self.heads(hidden).argmax(-1))

    def accept(self, ctx: StepContext) -> None:
        """Nothing to learn: the next step reads the hidden state from its context."""


@register_proposer(
    "medusa2"
)  # the heads of Medusa-2; load_runtime merges its adapter into the target first
@register_proposer("medusa")
def _build_medusa(
    export_dir: str | Path,
    config: dict,
    target_model: TargetDecoder,
    tree: list[list[int]] | None = None,
    top_k: int | None = None,
) -> MedusaProposer:
    """Medusa heads from an export, on the target's device/dtype; tree and top_k default to the
    export's."""
    from draftsmith.heads.medusa import MedusaHeads
    from draftsmith.runtime.target.fast_linear import accelerate_linears

    lm_head = target_model.lm_head_weight
    heads, _ = MedusaHeads.from_export(export_dir, lm_head_weight=lm_head)
    heads = heads.to(
        device=lm_head.device, dtype=lm_head.dtype
    )  # where and in the precision the target runs
    accelerate_linears(heads)  # bf16 on CPU: packed GEMM for the heads' linears
    return MedusaProposer(
        heads.eval(), static_tree_of(heads.config, config.get("inference", {}), tree, top_k)
    )


def static_tree_of(
    arch: Any, inference: dict, tree: list[list[int]] | None, top_k: int | None
) -> StaticTree:
    """The static tree of heads with architecture ``arch`` (``num_heads``, ``vocab_size``,
    ``draft_vocab_size``): ``tree`` / ``top_k`` (proposer options) over the export's ``inference``
    defaults. A shape that cannot run (no node, top_k outside the heads' vocabulary, deeper than the
    heads) is refused naming the option and its range.
    """
    vocab = getattr(arch, "draft_vocab_size", None) or arch.vocab_size
    if top_k is not None and (not isinstance(top_k, int) or not 1 <= top_k <= vocab):
        raise InputError(
            f"--proposer-option top_k={top_k!r} is out of range: an integer in 1..{vocab} (the"
            " heads' vocabulary)"
        )
    if tree is not None and (not isinstance(tree, list) or not tree):
        raise InputError(
            f"--proposer-option tree={tree!r} has no nodes: give a list of at least one path, e.g. "
            "tree='[[0],[1],[0,0]]'"
        )
    origin = "--proposer-option tree" if tree is not None else "the export's inference.tree"
    paths = tree or inference.get("tree")
    k = top_k or inference.get("top_k", 10)
    if not paths:
        from draftsmith.common.trees import default_medusa_tree

        paths = default_medusa_tree(arch.num_heads, top_k=min(k, 4))
    try:
        static = StaticTree.from_paths(paths, k)
    except (TypeError, ValueError) as err:
        raise InputError(f"{origin}: {err}") from err
    if static.depth > arch.num_heads:
        raise InputError(
            f"{origin} is {static.depth} deep, but the export has {arch.num_heads} heads (one per "
            f"depth): use paths of 1..{arch.num_heads} entries"
        )
    return static
