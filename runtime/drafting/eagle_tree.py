"""EAGLE-2 dynamic trees: how the EAGLE proposer (runtime/drafting/eagle_proposer.py) expands and
reranks a tree of drafted tokens.

The root step's top-k are the depth-1 nodes (score = log p). ``depth`` times, the frontier (k
nodes, each with its parent's drafter output) is fed in ONE forward with a tree mask (committed
pairs, its ancestors among the earlier tree entries, itself); each yields its top-k children with
cumulative score = parent + log p, and the global top-k of those k*k become the next frontier. All
generated nodes are then reranked and the best ``total_tokens - 1`` kept (stable sort in generation
order, so a parent, whose score is >= its child's, always precedes it: the kept set is a connected
tree). Children are deterministic given the context, i.e. point masses, which
:class:`~draftsmith.runtime.acceptance.rejection_sampling.RejectionSamplingVerifier` handles
exactly. A stop policy leaves a node without children when ``should_stop`` says so for the node's
:class:`~draftsmith.runtime.acceptance.stop_policies.StopContext`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from draftsmith.common.layers import KVCache
from draftsmith.runtime.acceptance.stop_policies import StopContext
from draftsmith.runtime.drafting.base import StepContext
from draftsmith.runtime.drafting.tree import DraftTree

if TYPE_CHECKING:
    from draftsmith.runtime.drafting.eagle_proposer import EagleProposer


@dataclass
class GeneratedNodes:
    """Every node drafted so far, per level, in generation order (parents before children)."""

    tokens: list[torch.Tensor]  # per level: target ids
    scores: list[torch.Tensor]  # per level: log of the product of confidences along the path
    local: list[torch.Tensor]  # per level: each node's log p under its parent
    parents: list[int]  # generation index of each node's parent; -1: the root's child

    def add_children(
        self, frontier: list[int], tokens: torch.Tensor, cum: torch.Tensor, logp: torch.Tensor
    ) -> int:
        """Record the k*k children of the k ``frontier`` nodes; -> the generation index of the
        first."""
        base, k = len(self.parents), len(frontier)
        self.tokens.append(tokens)
        self.scores.append(cum.flatten())
        self.local.append(logp.flatten())
        self.parents.extend(f for f in frontier for _ in range(k))  # child j*k+c of frontier node j
        return base


@dataclass
class Frontier:
    """The k nodes one tree step expands, each with what its children are drafted from."""

    nodes: list[int]  # generation indices
    tokens: torch.Tensor  # [k] target ids
    scores: torch.Tensor  # [k] path log-probs
    hidden: torch.Tensor  # [k, H]: each node's parent output
    ancestors: torch.Tensor  # [k, tree entries in the cache]
    stops: list[StopContext]  # each path's stop-policy context so far


@dataclass
class TreeStep:
    """One frontier expansion: the drafter's outputs and the children's path scores."""

    out: torch.Tensor  # [1, k, H]: every frontier node's drafter output
    child_logp: torch.Tensor  # [k, k]: every frontier node's top-k children's log p
    child_tokens: torch.Tensor  # [k*k] target ids
    cum: torch.Tensor  # [k, k]: path scores, -inf under a stopped node
    stops: list[StopContext]  # each frontier node's own stop context (with a stop policy)


def draft_dynamic_tree(
    proposer: EagleProposer,
    ctx: StepContext,
    out: torch.Tensor,
    head: tuple[torch.Tensor, torch.Tensor],
    cache: KVCache,
    levels: int,
) -> DraftTree:
    """An EAGLE-2 tree of ``levels`` levels from the root step's drafter output ``out`` [1, 1, H]
    and its top-k ``head`` (log-probs [k], draft ids [k])."""
    k, device = proposer.top_k, out.device
    logp, idx = head  # [k]: depth-1 nodes (the root step's top k), score = log p
    generated = GeneratedNodes([proposer._to_target(idx)], [logp], [logp], [-1] * k)
    if levels == 1:  # one level (e.g. a fixed:1 stop policy): the root step's top-k is the tree
        return rerank(proposer.total_tokens, ctx.root_token, generated)
    frontier = Frontier(
        nodes=list(range(k)),
        tokens=generated.tokens[0],
        scores=logp,
        hidden=out[0].expand(k, -1),  # [k, H]
        ancestors=torch.zeros(k, 0, dtype=torch.bool, device=device),
        stops=[StopContext(0, 1.0) for _ in range(k)],
    )
    # every node sees the committed pairs
    seen = torch.ones(k, proposer.num_committed, dtype=torch.bool, device=device)
    eye = torch.eye(k, dtype=torch.bool, device=device)
    for level in range(1, levels):
        step, cache = _expand(proposer, ctx, frontier, generated, seen, eye, cache, level)
        base = generated.add_children(frontier.nodes, step.child_tokens, step.cum, step.child_logp)
        if level == levels - 1:
            break
        frontier = _next_frontier(frontier, step, base, eye, ctx.stop_policy is not None)
    return rerank(proposer.total_tokens, ctx.root_token, generated)


def _expand(
    proposer: EagleProposer,
    ctx: StepContext,
    frontier: Frontier,
    generated: GeneratedNodes,
    seen: torch.Tensor,
    eye: torch.Tensor,
    cache: KVCache,
    level: int,
) -> tuple[TreeStep, KVCache]:
    """Draft every frontier node's top-k children in one forward (depth-``level`` nodes)."""
    k, device, policy = proposer.top_k, frontier.hidden.device, ctx.stop_policy
    mask = torch.cat([seen, frontier.ancestors, eye], dim=1)  # [k, committed + (level-1)*k + k]
    # depth-`level` nodes share one position
    positions = torch.full((1, k), proposer.num_committed - 1 + level, device=device)
    out, child_logp, child, cache = proposer._draft(
        frontier.hidden[None], frontier.tokens[None], cache, positions, mask, False, k
    )  # [k, k] each: every frontier node's top-k children
    cum = frontier.scores[:, None] + child_logp  # [k, k]: log of the product along the path
    stops: list[StopContext] = []
    if policy is not None:  # a stopped node keeps no children
        own_logp = torch.cat(generated.local)[frontier.nodes]  # [k] each node's log p
        stops = [
            frontier.stops[j].child(level, float(lp.exp()), out[0, j])
            for j, lp in enumerate(own_logp)
        ]
        stop = [policy.should_stop(c) for c in stops]
        cum = cum.masked_fill(torch.tensor(stop, device=device)[:, None], float("-inf"))
    child_tokens = proposer._to_target(child.flatten())  # [k*k]
    return TreeStep(out, child_logp, child_tokens, cum, stops), cache


def _next_frontier(
    frontier: Frontier, step: TreeStep, base: int, eye: torch.Tensor, stopping: bool
) -> Frontier:
    """The global top-k of the k*k children (``base``: the generation index of the first)."""
    k = len(frontier.nodes)
    scores, best = step.cum.flatten().topk(k)  # global top-k of the k*k children
    row = best // k  # which frontier node each is a child of
    return Frontier(
        nodes=(base + best).tolist(),
        tokens=step.child_tokens[best],
        scores=scores,
        hidden=step.out[0, row],
        # parent's ancestors + the parent itself
        ancestors=torch.cat([frontier.ancestors[row], eye[row]], dim=1),
        stops=[step.stops[int(r)] for r in row] if stopping else frontier.stops,
    )


def rerank(total_tokens: int, root: int, generated: GeneratedNodes) -> DraftTree:
    """Keep the best ``total_tokens - 1`` generated nodes (ties: earlier first), in generation
    order. A few dozen nodes: ranked as Python floats in microseconds (the torch
    sort/isfinite/scatter took ~0.2 ms a draft call).
    """
    score = _flat(generated.scores).tolist()  # [G]
    finite = [g for g, s in enumerate(score) if math.isfinite(s)]  # -inf: a stopped node's children
    # sorted() is stable (reverse=True too): equal scores keep generation order, as a stable
    # sort of -score
    keep = sorted(sorted(finite, key=score.__getitem__, reverse=True)[: total_tokens - 1])
    node_of = {g: n for n, g in enumerate(keep, 1)}  # generation index -> tree node (root: node 0)
    parents = [-1]
    for g in keep:
        p = generated.parents[g]
        # cannot happen: a parent's score is >= its child's and it comes first
        if p >= 0 and p not in node_of:
            raise RuntimeError("dynamic tree reranking kept a node without its parent")
        parents.append(node_of[p] if p >= 0 else 0)
    prefix = keep == list(range(len(keep)))  # usual for one level: a view, not a gather
    # [M] generation order
    rows = slice(0, len(keep)) if prefix else torch.tensor(keep, dtype=torch.long)
    conf = torch.cat([torch.ones(1), _flat(generated.local)[rows].exp()])  # [M+1]
    node_tokens = [root, *_flat(generated.tokens)[rows].tolist()]
    return DraftTree.from_parents(node_tokens, parents, draft_confidence=conf)


def _flat(parts: list[torch.Tensor]) -> torch.Tensor:
    """The per-level tensors of a draft as one CPU tensor [G] (no cat for a one-level tree)."""
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).cpu()
