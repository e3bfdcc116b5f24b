"""Draft shapes, not depths: what one speculative step drafts (a chain of depth d; a tree of at most
N nodes with branching b per level and depth d), the candidate shapes a proposer family supports,
applying one to a proposer, and the accepted length every candidate would have had on recorded
calibration steps.

Families (a proposer declares which in its ``shape_family``, a member of
:class:`~draftsmith.runtime.drafting.base.Proposer` like every other one read here):
- ``dynamic_tree`` (EAGLE-1/3): chain ``policy=chain, depth=d-1`` (the proposer drafts ``depth + 1``
  tokens); tree ``policy=tree, total_tokens=N, top_k=b, depth=d-1``;
- ``static_tree`` (Medusa family): the tree ``default_medusa_tree(num_heads, N - 1, b)`` (a chain: b
  = 1);
- ``depth``: depth only (``kind="depth"``, the stop policy's ``max_depth`` capped at d, up to
  ``draft_depth``).
Chains are 1..4 deep, or up to a proposer's ``shape_max_depth`` when it declares one (DFlash:
block_size - 1).

Predicting a shape from recorded steps: every calibration step drafted a superset tree and the
greedy verifier accepted one path of it. A node's rank path is its rank among its siblings (by
drafter confidence) at every level, its score the product of the confidences on its path. A shape
keeps the nodes of depth <= d whose ranks are all < b, then the best N - 1 by score (a static shape:
the nodes whose rank path is in its tree); its accepted length on that step is the longest prefix of
the accepted path it kept (exact for greedy verification of a subtree).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from draftsmith.common.errors import DraftsmithError
from draftsmith.runtime.acceptance.stop_policies import FixedDepth

if TYPE_CHECKING:
    from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
    from draftsmith.runtime.drafting.base import Proposer
    from draftsmith.runtime.drafting.tree import DraftTree

MAX_NODES = 16  # the largest tree a candidate may verify (root included)
MAX_CHAIN = 4  # chains of depth 1..MAX_CHAIN
BRANCHINGS = (2, 3, 4)  # tree branching per level (1 is a chain)
TREE_NODES = (3, 4, 5, 6, 8, 10, 12, 16)  # tree node budgets (root included)
TREE_DEPTHS = (
    1,
    2,
    3,
    4,
)  # depth 1: the root and its top-b children (fixed:1 of an EAGLE export is tree:5/b4/d1)


class ShapeError(DraftsmithError, ValueError):
    """A shape that cannot run (no drafted node, branching beyond the vocabulary, more nodes than
    levels allow)."""


@dataclass(frozen=True)
class Shape:
    """What one step drafts: ``kind`` "plain" (nothing), "chain", "tree" or "depth" (a cap on the
    export's own shape); ``depth`` drafted levels, ``nodes`` verified nodes at most (root included),
    ``branching`` per level.
    """

    kind: str
    depth: int = 0
    nodes: int = 1
    branching: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("plain", "chain", "tree", "depth"):
            raise ShapeError(f"unknown shape kind {self.kind!r}: plain | chain | tree | depth")
        if self.kind == "plain":
            return
        if self.depth < 1 or self.nodes < 2:
            raise ShapeError(
                f"shape {self.label} drafts no node: need depth >= 1 and at least 2 nodes (the root"
                f" and one drafted token), got depth={self.depth}, nodes={self.nodes}"
            )
        if self.branching < 1:
            raise ShapeError(f"shape {self.label}: branching must be >= 1, got {self.branching}")
        most = 1 + sum(self.branching ** (d + 1) for d in range(self.depth))
        if self.nodes > most or self.nodes < self.depth + 1:
            raise ShapeError(
                f"shape {self.label}: {self.nodes} nodes do not fit depth {self.depth} with"
                f" branching {self.branching} (between {self.depth + 1} and {most})"
            )

    @property
    def label(self) -> str:
        """A short name: ``plain``, ``chain:3``, ``tree:8/b2/d3``, ``depth:2``."""
        if self.kind == "tree":
            return f"tree:{self.nodes}/b{self.branching}/d{self.depth}"
        return "plain" if self.kind == "plain" else f"{self.kind}:{self.depth}"

    @classmethod
    def chain(cls, depth: int) -> Shape:
        """A chain of ``depth`` drafted tokens (``depth + 1`` verified nodes)."""
        return cls("chain", depth, depth + 1, 1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Shape:
        """The shape recorded by :func:`dataclasses.asdict` (the cache, bench.json)."""
        return cls(
            str(data["kind"]), int(data["depth"]), int(data["nodes"]), int(data["branching"])
        )


PLAIN = Shape("plain")


def family_of(proposer: Proposer) -> str:
    """``dynamic_tree`` | ``static_tree`` | ``depth`` (see the module docstring)."""
    return proposer.shape_family


def check_runnable(shape: Shape, proposer: Proposer) -> None:
    """Refuse a shape this proposer cannot draft (branching beyond its vocabulary, deeper than its
    heads)."""
    vocab = proposer.shape_vocab
    if vocab is not None and shape.branching > int(vocab):
        raise ShapeError(
            f"shape {shape.label}: branching {shape.branching} is larger than the drafter's"
            f" vocabulary ({vocab} tokens)"
        )
    heads = proposer.num_heads
    if family_of(proposer) == "static_tree" and heads is not None and shape.depth > int(heads):
        raise ShapeError(
            f"shape {shape.label} is {shape.depth} deep, but the proposer has {heads} heads"
        )
    if family_of(proposer) == "depth" and shape.kind not in ("plain", "depth"):
        raise ShapeError(
            f"shape {shape.label}: this proposer's shape is its export's; only its depth can change"
        )


def candidates(proposer: Proposer) -> list[Shape]:
    """Every shape the proposer's family supports: chains of depth 1..4 and trees of at most 16
    nodes with branching 2..4 (depth only for families without shape options), each runnable on this
    proposer."""
    if family_of(proposer) == "depth":
        top = min(MAX_CHAIN, int(proposer.draft_depth or MAX_CHAIN))
        return [Shape("depth", d, d + 1) for d in range(1, top + 1)]
    # A block drafter (DFlash) drafts its whole block in one forward: its chains may go past
    # MAX_CHAIN.
    shapes = [Shape.chain(d) for d in range(1, max(MAX_CHAIN, int(proposer.shape_max_depth)) + 1)]
    for b in BRANCHINGS:
        for d in TREE_DEPTHS:
            for n in TREE_NODES:
                try:
                    shape = Shape("tree", d, n, b)
                except ShapeError:
                    continue
                if n > d + 1:  # d + 1 nodes is at best a chain
                    shapes.append(shape)
    out = []
    for shape in dict.fromkeys(shapes):
        try:
            check_runnable(shape, proposer)
        except ShapeError:
            continue
        out.append(shape)
    return out


def medusa_paths(num_heads: int, shape: Shape) -> list[list[int]]:
    """The static tree of a Medusa-family shape (the one tree builder,
    :mod:`draftsmith.common.trees`)."""
    from draftsmith.common.trees import default_medusa_tree

    if shape.kind == "chain":
        return [[0] * (d + 1) for d in range(shape.depth)]
    paths = default_medusa_tree(min(num_heads, shape.depth), shape.nodes - 1, shape.branching)
    return sorted(paths, key=lambda p: (len(p), p))


def with_shape(proposer: Proposer, shape: Shape) -> Proposer:
    """A copy of ``proposer`` drafting ``shape`` (sharing its weights); the proposer itself for
    depth-only shapes."""
    check_runnable(shape, proposer)
    family = family_of(proposer)
    if family == "depth" or shape.kind == "plain":
        return proposer
    shaped = copy.copy(proposer)
    if family == "dynamic_tree":
        options = (
            {"policy": "chain", "depth": shape.depth - 1}
            if shape.kind == "chain"
            else {
                "policy": "tree",
                "total_tokens": shape.nodes,
                "top_k": shape.branching,
                "depth": shape.depth - 1,
            }
        )
        shaped.reshape(options)
    else:
        shaped.reshape(
            {"tree": medusa_paths(int(proposer.num_heads), shape), "top_k": max(1, shape.branching)}
        )
    return shaped


def apply_shape(
    spec: SpeculativeDecoder, shape: Shape, base_proposer: Proposer | None = None
) -> None:
    """Serve ``shape`` on the decoder ``spec`` from ``base_proposer`` (default: its proposer): plain
    decoding for :data:`PLAIN`, else the shaped proposer with the stop policy's depth capped at the
    shape's."""
    from draftsmith.runtime.drafting.base import NullProposer

    base = base_proposer if base_proposer is not None else spec.proposer
    if shape.kind == "plain":
        spec.proposer = NullProposer()
        return
    spec.proposer = with_shape(base, shape)
    policy = spec.stop_policy
    spec.stop_policy = (
        FixedDepth(shape.depth)
        if policy is None or isinstance(policy, FixedDepth)
        else dataclasses.replace(policy, max_depth=min(shape.depth, policy.max_depth))
    )


@dataclass
class RecordedStep:
    """One calibration step: the superset tree's parents, depths and confidences, and the accepted
    path (root first)."""

    parents: list[int]
    depths: list[int]
    confidence: list[float]
    accepted: list[int]


def record_step(tree: DraftTree, path_nodes: Sequence[int]) -> RecordedStep:
    """What :func:`accepted_length` needs from a verified tree (confidences 1 where the drafter gave
    none)."""
    conf = tree.draft_confidence
    n = tree.num_nodes
    return RecordedStep(
        [int(p) for p in tree.parents],
        [int(d) for d in tree.depths],
        [1.0] * n if conf is None else [float(c) for c in conf],
        [int(i) for i in path_nodes],
    )


def _rank_paths(step: RecordedStep) -> tuple[list[tuple[int, ...]], list[float]]:
    """Each node's rank path (rank among siblings by confidence, at every level) and score (product
    of confidences)."""
    n = len(step.parents)
    ranks = [0] * n
    for parent in set(step.parents[1:]):
        kids = sorted(
            (i for i in range(1, n) if step.parents[i] == parent),
            key=lambda i: (-step.confidence[i], i),
        )
        for r, i in enumerate(kids):
            ranks[i] = r
    paths: list[tuple[int, ...]] = [()]
    scores = [1.0]
    for i in range(1, n):  # parents come before children
        paths.append((*paths[step.parents[i]], ranks[i]))
        scores.append(scores[step.parents[i]] * step.confidence[i])
    return paths, scores


def kept_nodes(
    step: RecordedStep, shape: Shape, static_paths: set[tuple[int, ...]] | None = None
) -> set[int]:
    """The nodes of the recorded tree that ``shape`` would have drafted (see the module
    docstring)."""
    paths, scores = _rank_paths(step)
    n = len(paths)
    if static_paths is not None:
        return {0} | {i for i in range(1, n) if paths[i] in static_paths}
    if shape.kind == "depth":  # the export's own shape, cut at the depth
        return {0} | {i for i in range(1, n) if step.depths[i] <= shape.depth}
    eligible = [
        i for i in range(1, n) if step.depths[i] <= shape.depth and max(paths[i]) < shape.branching
    ]
    best = sorted(eligible, key=lambda i: (-scores[i], step.depths[i], i))[: shape.nodes - 1]
    return {0, *best}


def accepted_length(
    step: RecordedStep, shape: Shape, static_paths: set[tuple[int, ...]] | None = None
) -> tuple[int, int]:
    """(drafted tokens ``shape`` would have accepted on this step, nodes it would have verified)."""
    kept = kept_nodes(step, shape, static_paths)
    accepted = 0
    for node in step.accepted[1:]:
        if node not in kept:
            break
        accepted += 1
    return accepted, len(kept)


def static_paths_of(proposer: Proposer, shape: Shape) -> set[tuple[int, ...]] | None:
    """A static family's rank paths for ``shape`` (None for the other families)."""
    if family_of(proposer) != "static_tree":
        return None
    return {tuple(p) for p in medusa_paths(int(proposer.num_heads), shape)}


def calibration_proposer(proposer: Proposer) -> Proposer:
    """The proposer calibration drafts with: a superset of every candidate (EAGLE: 16 nodes, top-4,
    depth 4; Medusa: the union of every candidate's static tree); the proposer itself for depth-only
    families."""
    family = family_of(proposer)
    if family == "depth":
        return proposer
    if family == "dynamic_tree":
        return with_shape(proposer, Shape("tree", MAX_CHAIN, MAX_NODES, max(BRANCHINGS)))
    union = {
        tuple(p) for s in candidates(proposer) for p in medusa_paths(int(proposer.num_heads), s)
    }
    shaped = copy.copy(proposer)
    shaped.reshape(
        {
            "tree": sorted((list(p) for p in union), key=lambda p: (len(p), p)),
            "top_k": max(BRANCHINGS),
        }
    )
    return shaped


__all__ = [
    "PLAIN",
    "RecordedStep",
    "Shape",
    "ShapeError",
    "accepted_length",
    "apply_shape",
    "candidates",
    "record_step",
    "with_shape",
]
