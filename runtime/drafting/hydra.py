"""Hydra / Hydra++ heads as a proposer: a static sparse tree expanded head after head, each head
seeing the tokens drafted before it on its path.

The tree's shape is the export's ``inference.tree`` (Medusa choice paths: entry i at depth d = the
(i+1)-th best token of head d given the node's own path), calibrated at the end of training or the
calibration-free default. Depth d is expanded in ONE head call over its frontier: every node at
depth d-1 that has children gives a row ``prefix = [root, tokens on its path]`` [N, d]; head d-1
scores all rows at once and each node's children take its top-k ranks. With a prefix-attention layer
(Hydra++) the heads read the layer's output over the whole context, kept incrementally: ``begin``
feeds the prompt's target hidden states, ``accept`` the accepted path's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.common.errors import InputError
from draftsmith.common.layers import KVCache
from draftsmith.common.trees import default_medusa_tree
from draftsmith.runtime.acceptance.stop_policies import StopContext
from draftsmith.runtime.drafting.base import Proposer, StepContext, module_dtype, prune_tree
from draftsmith.runtime.drafting.registry import register_proposer
from draftsmith.runtime.drafting.tree import DraftTree, StaticTree
from draftsmith.runtime.target.interface import TargetDecoder


class HydraProposer(Proposer):
    """Sequentially dependent heads over a static tree (see the module docstring).

    ``heads`` provides ``context(hidden [1, S, H], cache=...) -> (ctx [1, S, H], cache)`` and
    ``step(ctx [N, H], prefix [N, d]) -> logits [N, V]`` (head d-1), as
    :class:`draftsmith.heads.hydra.HydraHeads` does.
    """

    # accept() never reads the target's logits: greedy verify may take argmaxes only
    reads_logits = False

    def __init__(
        self, heads: Any, tree: StaticTree | list[list[int]], top_k: int | None = None
    ) -> None:
        if not isinstance(tree, StaticTree):
            tree = StaticTree.from_paths(tree, top_k or 1 + max(c for p in tree for c in p))
        if tree.depth > heads.config.num_heads:
            raise InputError(
                f"the tree is {tree.depth} deep but the export has {heads.config.num_heads} heads"
            )
        self.heads, self.tree = heads, tree
        self.max_tree_nodes = tree.num_nodes
        self.uses_context = getattr(heads, "prefix", None) is not None
        self.dtype = module_dtype(
            heads
        )  # once: packed bf16 linears leave the heads without parameters
        self._cache: KVCache | None = None
        self._ctx: torch.Tensor | None = None  # [H] the heads' context state at the root's position
        self._by_depth = [
            [i for i in range(tree.num_nodes) if int(tree.depths[i]) == d]
            for d in range(tree.depth + 1)
        ]

    def _feed(self, hidden: torch.Tensor) -> None:
        """Run the prefix layer over new context rows hidden [S, H]; keep the last output."""
        ctx, self._cache = self.heads.context(
            hidden[None].to(self.dtype), cache=self._cache
        )  # [1, S, H]
        self._ctx = ctx[0, -1]

    def begin(self, ctx: StepContext) -> None:
        """New generation: restart the prefix layer's cache on the prompt's hidden states."""
        self._cache, self._ctx = None, None
        if self.uses_context:
            self._feed(ctx.hidden)

    def accept(self, ctx: StepContext) -> None:
        """Extend the prefix layer's context with the accepted path's hidden states [a+1, H]."""
        if self.uses_context:
            self._feed(ctx.hidden)

    @torch.no_grad()
    def propose(self, ctx: StepContext) -> DraftTree:
        """Expand the static tree depth by depth, one head call per depth."""
        state = self._ctx if self.uses_context else ctx.hidden.to(self.dtype)  # [H]
        if state is None:
            raise RuntimeError(
                "HydraProposer has no context: call begin() at the start of a generation"
            )
        tree, n = self.tree, self.tree.num_nodes
        tokens = torch.zeros(n, dtype=torch.long)
        tokens[0] = ctx.root_token
        conf = torch.ones(n)
        paths = [[ctx.root_token]] + [[] for _ in range(n - 1)]  # tokens from the root to each node
        for depth in range(1, tree.depth + 1):
            parents = sorted({int(tree.parents[i]) for i in self._by_depth[depth]})
            prefix = torch.tensor([paths[p] for p in parents], device=state.device)  # [N, depth]
            logits = self.heads.step(state.expand(len(parents), -1), prefix)  # [N, V]
            probs, top = torch.softmax(logits.float(), -1).topk(tree.top_k, dim=-1)  # [N, top_k]
            row = {p: r for r, p in enumerate(parents)}
            for i in self._by_depth[depth]:
                rank = tree.paths[i - 1][-1]
                r = row[int(tree.parents[i])]
                tokens[i], conf[i] = int(top[r, rank]), float(probs[r, rank])
                paths[i] = paths[int(tree.parents[i])] + [int(tokens[i])]
        draft = DraftTree(tokens, tree.parents, tree.depths, tree.tree_mask, tree.retrieve_indices)
        draft.draft_confidence = conf
        return self._apply_stop_policy(draft, ctx, conf, state)

    def _apply_stop_policy(
        self, draft: DraftTree, ctx: StepContext, conf: torch.Tensor, state: torch.Tensor
    ) -> DraftTree:
        """Prune children of nodes where the stop policy says stop (each path keeps its own policy
        context)."""
        policy = ctx.stop_policy
        if policy is None:
            return draft
        n = draft.num_nodes
        keep, expand = [True] * n, [policy.max_depth > 0] + [False] * (n - 1)
        stops = [StopContext(0, 1.0, state)]
        for i in range(1, n):
            parent = int(draft.parents[i])
            stops.append(stops[parent].child(int(draft.depths[i]), float(conf[i]), state))
            keep[i] = keep[parent] and expand[parent]
            if keep[i]:
                expand[i] = not policy.should_stop(stops[i])
        return draft if all(keep) else prune_tree(draft, keep)


def _build_hydra(
    export_dir: str | Path,
    config: dict,
    target_model: TargetDecoder,
    tree: list[list[int]] | None = None,
    top_k: int | None = None,
) -> HydraProposer:
    """Hydra heads from an export, on the target's device and dtype; tree and top_k default to the
    export's."""
    from draftsmith.heads.hydra import HydraHeads
    from draftsmith.runtime.target.fast_linear import accelerate_linears

    embed, lm_head = target_model.embed_weight, target_model.lm_head_weight
    heads, _ = HydraHeads.from_export(export_dir, embed_weight=embed, lm_head_weight=lm_head)
    heads = heads.to(device=lm_head.device, dtype=lm_head.dtype).eval()
    accelerate_linears(heads)  # bf16 on CPU: packed GEMM for the heads' linears
    inference = config.get("inference", {})
    k = top_k or inference.get("top_k", 10)
    paths = (
        tree
        or inference.get("tree")
        or default_medusa_tree(heads.config.num_heads, top_k=min(k, 4))
    )
    return HydraProposer(heads, StaticTree.from_paths(paths, k))


register_proposer("hydra")(_build_hydra)
register_proposer("hydra_pp")(_build_hydra)
