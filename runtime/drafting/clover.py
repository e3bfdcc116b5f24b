"""Clover-2 heads as a proposer: a static sparse tree expanded head after head through the
regressive connection.

Context: pair ``t`` is ``(p_t, x_{t+1})`` with ``p_t`` the target's pre-final-norm last hidden state
(the target tap ``num_layers``). ``begin`` feeds the prompt's pairs (the last one pairs with the
root), ``accept`` the accepted path's (root's state with the first accepted token, ..., the last
accepted node's with the bonus token), so the augmenting block's KV cache holds exactly the
committed context and ``c`` of the last pair drafts the next tree.

Drafting (the export's ``inference.tree``, Medusa choice paths): the root's children are the top-k
of head 0, ``first(c)``; a node at depth d >= 1 gets the regressive state ``S = step(S_parent, its
token)`` (``S_root = c``), whose logits rank its children. Every depth runs ONE ``step`` call over
its frontier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.common.trees import default_medusa_tree
from draftsmith.runtime.drafting.base import StepContext
from draftsmith.runtime.drafting.hydra import HydraProposer
from draftsmith.runtime.drafting.registry import register_proposer
from draftsmith.runtime.drafting.tree import DraftTree, StaticTree
from draftsmith.runtime.target.interface import TargetDecoder


class CloverProposer(HydraProposer):
    """Clover-2 over a static tree (see the module docstring); the stop policy works as for
    Hydra."""

    def __init__(
        self,
        heads: Any,
        tree: StaticTree | list[list[int]],
        num_layers: int,
        top_k: int | None = None,
    ) -> None:
        super().__init__(heads, tree, top_k)
        self.feature_taps = (
            int(num_layers),
        )  # the pre-final-norm residual stream of every forwarded token
        self._caches: list | None = None
        # [H] augmenting block output of the last committed pair
        self._c: torch.Tensor | None = None

    def _pairs(self, prenorm: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Feed pairs (p [S, H], x [S]) to the augmenting block; keep the last pair's output."""
        dtype = self.dtype
        c, self._caches = self.heads.context(
            prenorm[None].to(dtype),
            next_tokens.reshape(1, -1).to(prenorm.device),
            caches=self._caches,
        )  # [1, S, H]
        self._c = c[0, -1]

    def begin(self, ctx: StepContext) -> None:
        """The prompt's pairs: p_t of prompt position t with the token after it (the root for the
        last one)."""
        if ctx.taps is None:
            raise ValueError(
                "Clover-2 needs the target's pre-norm hidden states (tap "
                f"{self.feature_taps[0]}); run it with a SpeculativeDecoder"
            )
        self._caches, self._c = None, None
        self._pairs(ctx.taps, ctx.tokens[1:])

    def accept(self, ctx: StepContext) -> None:
        """The accepted path's pairs: each accepted node's p with the token after it (finally the
        bonus token)."""
        acc = ctx.acceptance
        self._pairs(ctx.taps, torch.tensor([*acc.accepted_tokens, acc.bonus_token]))

    @torch.no_grad()
    def propose(self, ctx: StepContext) -> DraftTree:
        """Expand the static tree depth by depth through the regressive connection."""
        if self._c is None:
            raise RuntimeError(
                "CloverProposer has no context: call begin() at the start of a generation"
            )
        tree, n = self.tree, self.tree.num_nodes
        tokens = torch.zeros(n, dtype=torch.long)
        tokens[0] = ctx.root_token
        conf = torch.ones(n)
        states: dict[int, torch.Tensor] = {
            0: self._c
        }  # regressive state of each node that has children
        for depth in range(1, tree.depth + 1):
            parents = sorted({int(tree.parents[i]) for i in self._by_depth[depth]})
            if depth == 1:
                _, _, logits = self.heads.first(self._c[None])  # [1, V]
            else:
                prev = torch.stack(
                    [states[int(tree.parents[p])] for p in parents]
                )  # [N, H] grandparents' states
                new, _, logits = self.heads.step(
                    prev, tokens[parents].to(prev.device)
                )  # [N, H], [N, V]
                states.update({p: new[r] for r, p in enumerate(parents)})
            probs, top = torch.softmax(logits.float(), -1).topk(tree.top_k, dim=-1)  # [N, top_k]
            row = {p: r for r, p in enumerate(parents)}
            for i in self._by_depth[depth]:
                r, rank = row[int(tree.parents[i])], tree.paths[i - 1][-1]
                tokens[i], conf[i] = int(top[r, rank]), float(probs[r, rank])
        draft = DraftTree(tokens, tree.parents, tree.depths, tree.tree_mask, tree.retrieve_indices)
        draft.draft_confidence = conf
        return self._apply_stop_policy(draft, ctx, conf, self._c)


@register_proposer("clover2")
def _build_clover(
    export_dir: str | Path,
    config: dict,
    target_model: TargetDecoder,
    tree: list[list[int]] | None = None,
    top_k: int | None = None,
) -> CloverProposer:
    """Clover-2 heads from an export on the target's device and dtype; tree and top_k default to the
    export's."""
    from draftsmith.heads.clover import CloverHeads
    from draftsmith.runtime.target.fast_linear import accelerate_linears

    embed, lm_head = target_model.embed_weight, target_model.lm_head_weight
    source = config["architecture"].get("embed_source", "embed")
    heads, _ = CloverHeads.from_export(
        export_dir, embed_weight=lm_head if source == "lm_head" else embed, lm_head_weight=lm_head
    )
    heads = heads.to(device=lm_head.device, dtype=lm_head.dtype).eval()
    # The V-wide LM head is the target's own: draft through the target's fast (packed) head, as
    # EAGLE does.
    heads.lm_head_fn = target_model.lm_head_logits
    accelerate_linears(heads)
    num_layers = target_model.sizes.num_layers
    inference = config.get("inference", {})
    k = top_k or inference.get("top_k", 10)
    paths = (
        tree
        or inference.get("tree")
        or default_medusa_tree(heads.config.num_heads, top_k=min(k, 4))
    )
    return CloverProposer(heads, StaticTree.from_paths(paths, k), num_layers)
