"""DFlash proposer: one drafter forward drafts a whole block, verified as a chain (greedy or exact
rejection sampling).

Context features (drafters/dflash.py's alignment): the drafter sees the target's taps of every
position whose target forward has run, i.e. the prompt (``begin``) and then each step's accepted
nodes (``accept``: the root and the accepted drafts); the root (bonus) token itself has no target
state yet and sits in block slot 0. The context is kept
incrementally: each new position's per-layer keys/values (``fc`` + ``hidden_norm`` +
``k_proj``/``k_norm``/RoPE, ``v_proj``) are computed once when it is accepted and appended, never
recomputed; rejected drafts never enter it.

``propose`` runs the full block ``[root, mask * (B-1)]`` at positions ``C .. C+B-1`` over the ``C``
context positions (the block is non-causal, so it is always run whole: cutting it would change the
earlier slots' outputs), then reads slots ``1 .. depth`` through the target's LM head: greedy (point
masses), or with ``temperature > 0`` sampled from q = softmax(logits / temperature) within ``top_p``
with q recorded for the rejection sampler. With a Markov head the slots are read one after another,
each with its predecessor's drafted token. A stop policy (``--stop-policy``, or the confidence cut)
sees each slot's :class:`StopContext`; its ``state`` is the confidence head's input when the drafter
has one, so SpecDec++'s :class:`LearnedStop` rule applies unchanged.

Confidence cut (``cut`` in (0, 1), needs a confidence head): :class:`LearnedStop` over the head seen
as a rejection head (:class:`~draftsmith.drafters.dflash_heads.RejectLogit`) with ``threshold = 1 -
cut``: drafting stops after the first slot at which the product of the head's per-slot acceptance
probabilities falls below ``cut``.

Trees (``tree`` = Medusa-style choice paths and ``top_k``, from the export's inference block,
``--proposer-option`` or the cost-aware shape choice: ``shape_family = "static_tree"``, one "head"
per slot): the slots' top-k fill a static tree
(:class:`~draftsmith.runtime.drafting.tree.StaticTree`), every node a point mass; with a Markov head
each slot is read after its predecessor's greedy token (the tree's first branch). A tree that is a
single path is drafted as a chain (with the stop policy and the cut). Drafting cost does not grow
with depth (one block forward), which is what depth_choice.py assumes of static-tree families.

Why this is lossless: the verified chain is a tree with one path; greedy drafts are point masses and
sampled drafts carry their q, which :mod:`~draftsmith.runtime.acceptance.verifiers` handles exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from draftsmith.common.errors import InputError
from draftsmith.drafters.dflash import ContextKV, DFlashDrafter
from draftsmith.drafters.dflash_heads import RejectLogit, confidence_input
from draftsmith.export.format import TargetMismatchError
from draftsmith.runtime.acceptance.stop_policies import (
    LearnedStop,
    StopContext,
    StopPolicy,
    bind_learned_head,
)
from draftsmith.runtime.acceptance.verifiers import on_generator_device, target_probs
from draftsmith.runtime.drafting.base import Proposer, StepContext, prune_tree
from draftsmith.runtime.drafting.registry import register_chain, register_proposer
from draftsmith.runtime.drafting.tree import DraftTree, StaticTree
from draftsmith.runtime.target.fast_linear import accelerate_linears
from draftsmith.runtime.target.interface import TargetDecoder


class DFlashProposer(Proposer):
    """Drafts ``depth`` (<= block_size - 1) tokens per step with a DFlash drafter (see the module
    docstring)."""

    # accept() never reads the target's logits: greedy verify may take argmaxes only
    reads_logits = False

    # runtime/shapes/draft_shapes.py: one "head" per block slot, trees through reshape()
    shape_family = "static_tree"

    def __init__(
        self,
        drafter: DFlashDrafter,
        head: Any = None,
        depth: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        cut: float = 0.0,
    ) -> None:
        block = drafter.config.block_size
        depth = block - 1 if depth is None else depth
        if not isinstance(depth, int) or not 1 <= depth <= block - 1:
            raise InputError(
                f"DFlash depth must be an integer in 1..{block - 1} (block_size - 1), got {depth!r}"
            )
        if temperature < 0 or not 0 < top_p <= 1:
            raise InputError(
                f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}"
            )
        if not 0 <= cut < 1:
            raise InputError(f"the confidence cut must be in [0, 1) (0 = off), got {cut}")
        if cut > 0 and drafter.confidence_head is None:
            raise InputError(
                f"cut={cut} needs a confidence head; this DFlash export was trained without one "
                "(drafter.confidence_head=false)"
            )
        self.drafter, self.head = drafter.eval(), head or drafter.logits
        self.depth, self.temperature, self.top_p, self.cut = depth, temperature, top_p, cut
        self.feature_taps = tuple(drafter.config.target_layers)
        self.max_tree_nodes = depth + 1
        self.num_heads = self.shape_max_depth = block - 1  # shapes.py: chain depths 1..block_size-1
        self.shape_vocab = drafter.config.vocab_size
        self.tree: StaticTree | None = None  # None: draft a chain
        self.reject_head = (
            RejectLogit(drafter.confidence_head) if drafter.confidence_head is not None else None
        )
        self.cut_policy = LearnedStop(self.reject_head, 1.0 - cut, depth) if cut > 0 else None
        self.ctx: ContextKV | None = None
        self.ctx_len = 0  # context positions fed (0 .. ctx_len-1)

    def reshape(self, options: dict[str, Any]) -> None:
        """Draft another shape from now on: ``tree`` (choice paths or a StaticTree) with ``top_k``,
        or ``depth`` (a chain) and ``cut``; the drafter and its context are kept."""
        options = dict(options)
        tree = options.pop("tree", None)
        if tree is not None:
            top_k = options.pop("top_k", None)
            tree = (
                tree
                if isinstance(tree, StaticTree)
                else StaticTree.from_paths(tree, top_k or 1 + max(c for p in tree for c in p))
            )
            if tree.depth > self.num_heads:
                raise InputError(
                    f"a tree {tree.depth} deep needs {tree.depth} draft slots; this DFlash block"
                    f" has {self.num_heads} (block_size - 1)"
                )
            if max(max(p) for p in tree.paths) > 0:  # branches: the static tree
                self.tree, self.max_tree_nodes = tree, tree.num_nodes
                return
            options["depth"] = tree.depth  # a single path: the chain, with its stop policy and cut
        probe = DFlashProposer(
            self.drafter,
            self.head,
            options.get("depth", self.depth),
            self.temperature,
            self.top_p,
            options.get("cut", self.cut),
        )
        self.depth, self.cut, self.cut_policy = probe.depth, probe.cut, probe.cut_policy
        self.max_tree_nodes, self.tree = probe.max_tree_nodes, None

    # ---- context ---------------------------------------------------------------------------------
    def begin(self, ctx: StepContext) -> None:
        """New generation: the prompt's taps [P, k*H] become context positions 0..P-1."""
        self.ctx, self.ctx_len = None, 0
        self._append(ctx.taps)

    def accept(self, ctx: StepContext) -> None:
        """The accepted nodes' taps [a+1, k*H] (root first) extend the context."""
        self._append(ctx.taps)

    @torch.no_grad()
    def _append(self, taps: torch.Tensor | None) -> None:
        if taps is None:
            raise ValueError(
                f"the DFlash drafter needs the target's layer taps {list(self.feature_taps)}; run"
                " it with a SpeculativeDecoder, which requests them from the target forward"
            )
        m = taps.shape[0]
        positions = torch.arange(self.ctx_len, self.ctx_len + m, device=taps.device)[None]  # [1, m]
        new = self.drafter.context(taps[None], positions)  # per layer (k, v) [1, nkv, m, d]
        self.ctx = (
            new
            if self.ctx is None
            else [
                (torch.cat((k0, k1), 2), torch.cat((v0, v1), 2))
                for (k0, v0), (k1, v1) in zip(self.ctx, new)
            ]
        )
        self.ctx_len += m

    # ---- drafting --------------------------------------------------------------------------------
    def _policy(self, ctx: StepContext) -> StopPolicy | None:
        if ctx.stop_policy is None:
            return self.cut_policy
        return (
            bind_learned_head(ctx.stop_policy, self.reject_head)
            if self.reject_head is not None
            else ctx.stop_policy
        )

    @torch.no_grad()
    def propose(self, ctx: StepContext) -> DraftTree:
        """Draft a chain rooted at ``ctx.root_token`` from one block forward."""
        if self.ctx is None or self.ctx_len != ctx.tokens.numel() - 1:
            raise RuntimeError(
                f"DFlashProposer is out of sync with the decoding loop: {self.ctx_len} context "
                f"positions for {ctx.tokens.numel() - 1} tokens; call begin() per generation and "
                "accept() after every verified draft (SpeculativeDecoder does)"
            )
        d, policy = self.drafter, self._policy(ctx)
        depth = self.depth if self.tree is None else self.tree.depth
        levels = depth if policy is None else min(depth, policy.max_depth)
        if levels < 1:
            return DraftTree.chain([ctx.root_token])
        device = self.ctx[0][0].device
        root = torch.tensor([ctx.root_token], device=device)
        positions = torch.arange(self.ctx_len, self.ctx_len + d.config.block_size, device=device)[
            None
        ]  # [1, S]
        hidden = d.block_forward(d.block_tokens(root), positions, self.ctx)[0]  # [S, H]
        if self.tree is not None:
            return self._static_tree(ctx, hidden, levels)
        return self._read_slots(ctx, hidden, levels, policy)

    def _static_tree(self, ctx: StepContext, hidden: torch.Tensor, levels: int) -> DraftTree:
        """Fill the static tree from the slots' top-k (point masses), cut at ``levels`` deep."""
        d, depth = self.drafter, self.tree.depth
        if d.markov_head is None:
            logits = self.head(d.head_input(hidden[1 : depth + 1]))  # [D, V]: one LM-head pass
        else:  # each slot after its predecessor's greedy token
            rows, prev = [], torch.tensor([ctx.root_token], device=hidden.device)
            for k in range(1, depth + 1):
                rows.append(self.head(d.head_input(hidden[k : k + 1], prev)))  # [1, V]
                prev = rows[-1].argmax(-1)
            logits = torch.cat(rows)  # [D, V]
        probs, top = torch.softmax(logits.float(), -1).topk(self.tree.top_k, dim=-1)  # [D, top_k]
        tree = self.tree.build(ctx.root_token, top)
        index = self.tree.candidate_index.to(probs.device)
        tree.draft_confidence = torch.cat([probs.new_ones(1), probs.reshape(-1)])[
            index
        ].cpu()  # [N]
        if levels < depth:  # a stop policy's max_depth
            tree = prune_tree(tree, [int(x) <= levels for x in tree.depths])
        return tree

    def _read_slots(
        self, ctx: StepContext, hidden: torch.Tensor, levels: int, policy: StopPolicy | None
    ) -> DraftTree:
        """Draft slots 1..levels of the block's states ``hidden`` [S, H] (see the module
        docstring)."""
        d = self.drafter
        # [levels, H]
        batched = None if d.markov_head is not None else d.head_input(hidden[1 : levels + 1])
        # [levels, V]: one LM-head pass
        all_logits = None if batched is None else self.head(batched)
        tokens, confs, qs, stop = [ctx.root_token], [1.0], [], StopContext(0, 1.0)
        prev = torch.tensor([ctx.root_token], device=hidden.device)
        for k in range(1, levels + 1):
            head_in = (
                d.head_input(hidden[k : k + 1], prev) if batched is None else batched[k - 1 : k]
            )  # [1, H]
            logits = (self.head(head_in) if all_logits is None else all_logits[k - 1 : k])[
                0
            ].float()  # [V]
            if self.temperature > 0:
                q = on_generator_device(
                    target_probs(logits, self.temperature, self.top_p), ctx.generator
                )
                x = torch.multinomial(q, 1, generator=ctx.generator)  # [1]
                qs.append(self._recorded_law(q))
            else:
                q = torch.softmax(logits, -1)  # [V] only for the confidence
                x = q.argmax().reshape(1)
            confs.append(float(q[x]))
            prev = x.to(hidden.device)
            tokens.append(int(x))
            if k == levels:
                break
            state = (
                head_in[0]
                if self.reject_head is None
                else confidence_input(
                    head_in[0], F.embedding(prev, d.embed_weight)[0].to(head_in.dtype)
                )
            )  # [H] or [2H]
            stop = stop.child(k, confs[-1], state)
            if policy is not None and policy.should_stop(stop):
                break
        return DraftTree.drawn_chain(tokens, qs, confs)

    @staticmethod
    def _recorded_law(q: torch.Tensor) -> torch.Tensor:
        """The law a sampled slot was drawn from, as the rejection sampler reads it (float64,
        CPU)."""
        return q.double().cpu()


# ---- builder from an export folder ---------------------------------------------------------------


def _place(drafter: DFlashDrafter, target_model: TargetDecoder) -> DFlashDrafter:
    """Run the drafter where and in the precision the target runs (bf16 CPU linears through the
    packed kernel)."""
    w = target_model.lm_head_weight
    drafter = drafter.to(device=w.device, dtype=w.dtype).eval()
    accelerate_linears(drafter)
    return drafter


@register_chain("dflash")
def _dflash_chain(tokens: int) -> dict[str, Any]:
    """A chain of ``tokens`` drafted tokens (at most block_size - 1)."""
    return {"depth": int(tokens)}


@register_proposer("dflash")
def _build_dflash(
    export_dir: str | Path, config: dict, target_model: TargetDecoder, **options: Any
) -> DFlashProposer:
    """DFlash proposer; options: depth (1..block_size-1), cut (confidence threshold, 0 = off),
    temperature, top_p, tree (choice paths) with top_k. Defaults: the export's ``inference`` block.
    The target was already checked against the export's identity by ``build_proposer`` (the only
    caller)."""
    valid = {"depth", "cut", "temperature", "top_p", "tree", "top_k"}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise InputError(
            f"unknown option(s) {unknown} for the dflash proposer; valid: {sorted(valid)}"
        )
    layers = [int(i) for i in config["architecture"].get("target_layers", [])]
    num_layers = target_model.sizes.num_layers
    if any(not 0 <= i < num_layers for i in layers):
        raise TargetMismatchError(
            f"the dflash drafter taps target layers {layers}, outside 0..{num_layers - 1} of "
            "the loaded target; use the target it was trained for"
        )
    drafter, _ = DFlashDrafter.from_export(
        export_dir,
        embed_weight=target_model.embed_weight,
        lm_head_weight=target_model.lm_head_weight,
    )
    inference = config.get("inference") or {}
    kw = {"depth": inference.get("depth"), "cut": float(inference.get("cut", 0.0) or 0.0)}
    kw.update({k: v for k, v in options.items() if v is not None})
    tree = {
        "tree": kw.pop("tree", inference.get("tree")),
        "top_k": kw.pop("top_k", inference.get("top_k")),
    }
    head = target_model.lm_head_logits  # the same weights, through the target's fast linears
    if tree["tree"] is None and tree["top_k"] is not None:
        raise InputError(
            "the dflash proposer's top_k sizes a tree: give tree (choice paths, e.g. [[0], [1], [0,"
            " 0]]) too, or leave top_k out for a chain"
        )
    proposer = DFlashProposer(_place(drafter, target_model), head, **kw)
    if tree["tree"] is not None:
        proposer.reshape(tree)
    return proposer


__all__ = ["DFlashProposer"]
