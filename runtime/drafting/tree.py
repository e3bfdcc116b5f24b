"""Draft trees: the static Medusa trees (lists of choice paths), their construction, and the
per-step DraftTree.

Conventions (shared with :mod:`draftsmith.kernels`): node 0 is the root (the last emitted token, not
yet in the KV cache); every node sees itself and its ancestors; ``retrieve_indices [P, D+1]`` lists
the root->leaf paths, -1 padded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from draftsmith.common.errors import InputError


@functools.lru_cache(maxsize=1024)
def tree_template(
    parents: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(parents [N], tree_mask [N, N], depths [N], retrieve_indices [P, D+1]) of a tree shape, built
    once per shape: a chain drafter or a dynamic tree redrafts the same few shapes every step, and
    building the mask in Python cost ~0.1 ms a step. The tensors are shared by every tree of that
    shape: read-only by convention."""
    mask, depths, retrieve = _masks_from_parents(list(parents))
    return torch.tensor(parents, dtype=torch.long), mask, depths, retrieve


def _masks_from_parents(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tree_mask [N, N], depths [N] and retrieve_indices [P, D+1] from a parent list (parents[i] <
    i, root -1)."""
    n = len(parents)
    rows: list[list[bool]] = []
    depths = [0] * n
    for i, p in enumerate(parents):
        if i > 0 and not 0 <= p < i:
            raise ValueError(
                f"node {i} has parent {p}; parents must precede their children (root = node 0)"
            )
        # ancestors of the parent are ancestors of the child
        row = list(rows[p]) if p >= 0 else [False] * n
        row[i] = True
        rows.append(row)
        depths[i] = depths[p] + 1 if p >= 0 else 0
    mask = torch.tensor(rows, dtype=torch.bool)  # [N, N]
    has_child = [False] * n
    for p in parents[1:]:
        has_child[p] = True
    leaves = [i for i in range(n) if not has_child[i]]
    max_depth = max(depths)
    retrieve = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        path = []
        node = leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        retrieve[row, : len(path)] = torch.tensor(path[::-1])
    return mask, torch.tensor(depths, dtype=torch.long), retrieve


@dataclass
class DraftTree:
    """One step's draft: N nodes, root first, parents before children.

    ``draft_q`` / ``draft_mode`` describe how the children of each node were drawn, for lossless
    sampling:
    - ``"point_mass"`` (``draft_q`` None): children are deterministic (top-k of a drafter, Medusa
      heads, a greedy chain);
    - ``"with_replacement"``: the children of node p were drawn i.i.d. from ``draft_q[p]`` (a
      distribution over V);
    - ``"without_replacement"``: drawn one after another from ``draft_q[p]`` with earlier siblings
      removed.
    A chain drafter's output is a tree with one path.
    """

    tokens: torch.Tensor  # [N] long
    parents: torch.Tensor  # [N] long, root -1
    depths: torch.Tensor  # [N] long
    tree_mask: torch.Tensor  # [N, N] bool
    retrieve_indices: torch.Tensor  # [P, D+1] long, -1 padded
    # [N, V] float: row p = distribution the children of node p were drawn from
    draft_q: torch.Tensor | None = None
    draft_mode: str = "point_mass"
    # [N] optional drafter confidence per node (for stop policies / logs)
    draft_confidence: torch.Tensor | None = None

    MODES = ("point_mass", "with_replacement", "without_replacement")

    def __post_init__(self) -> None:
        if self.draft_mode not in self.MODES:
            raise ValueError(f"draft_mode must be one of {self.MODES}, got {self.draft_mode!r}")
        if self.draft_mode != "point_mass" and self.draft_q is None:
            raise ValueError(
                f"draft_mode {self.draft_mode!r} needs draft_q "
                "(the distribution the children were drawn from)"
            )

    @property
    def num_nodes(self) -> int:
        """Number of nodes including the root."""
        return int(self.tokens.numel())

    def children(self, node: int) -> list[int]:
        """Children of ``node`` in tree order (the order in which they were drafted)."""
        return [int(i) for i in torch.nonzero(self.parents == node).flatten()]

    @classmethod
    def from_parents(
        cls,
        tokens: torch.Tensor | list[int],
        parents: list[int],
        draft_q: torch.Tensor | None = None,
        draft_mode: str = "point_mass",
        draft_confidence: torch.Tensor | None = None,
    ) -> DraftTree:
        """Build a tree from node tokens and a parent list (parents[0] = -1, parents[i] < i)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        if tokens.dim() != 1 or len(parents) != tokens.numel() or parents[0] != -1:
            raise ValueError(
                "tokens [N] and parents [N] must have the same length, with parents[0] = -1 for the"
                " root"
            )
        parent_ids, mask, depths, retrieve = tree_template(tuple(int(p) for p in parents))
        return cls(
            tokens, parent_ids, depths, mask, retrieve, draft_q, draft_mode, draft_confidence
        )

    @classmethod
    def chain(
        cls,
        tokens: torch.Tensor | list[int],
        draft_q: torch.Tensor | None = None,
        draft_mode: str = "point_mass",
    ) -> DraftTree:
        """A single path: root, then the drafted tokens in order."""
        n = len(tokens)
        return cls.from_parents(tokens, [i - 1 for i in range(n)], draft_q, draft_mode)

    @classmethod
    def drawn_chain(
        cls, tokens: list[int], qs: list[torch.Tensor], confidences: list[float]
    ) -> DraftTree:
        """A chain a drafter drew node by node: ``qs[i]`` [V] is the law node i's child was drawn
        from (none for greedy drafts: point masses), the leaf has none; ``confidences`` are the
        draft probabilities of the nodes.
        """
        if qs:
            tree = cls.chain(
                tokens, torch.stack(qs + [torch.zeros_like(qs[0])]), "with_replacement"
            )  # [N, V]
        else:
            tree = cls.chain(tokens)
        tree.draft_confidence = torch.tensor(confidences)
        return tree


@dataclass
class StaticTree:
    """A Medusa static tree: node 0 is the root, node i (i >= 1) is ``paths[i-1]`` after sorting by
    (depth, path)."""

    paths: list[tuple[int, ...]]
    top_k: int
    tree_mask: torch.Tensor  # [N+1, N+1] bool
    depths: torch.Tensor  # [N+1]
    parents: torch.Tensor  # [N+1], root -1
    retrieve_indices: torch.Tensor  # [P, D+1], -1 padded
    # [N+1] index into [root] + concat(top-k of head 0, top-k of head 1, ...)
    candidate_index: torch.Tensor

    @classmethod
    def from_paths(cls, paths: list[list[int]], top_k: int) -> StaticTree:
        """Precompute masks and indices for Medusa choice paths (entry i at depth d = top-(i+1) of
        head d)."""
        if not paths:
            raise InputError("a static tree needs at least one path, e.g. [[0]]")
        norm = sorted({tuple(int(c) for c in p) for p in paths}, key=lambda p: (len(p), p))
        if len(norm) != len(paths):
            raise InputError("duplicate paths in the tree")
        index = {p: i + 1 for i, p in enumerate(norm)}
        parents = [-1]
        for p in norm:
            if not p or min(p) < 0 or max(p) >= top_k:
                raise InputError(
                    f"path {list(p)} must be non-empty with entries in [0, top_k={top_k})"
                )
            if len(p) > 1 and p[:-1] not in index:
                raise InputError(
                    f"path {list(p)} has no parent path {list(p[:-1])}; every prefix must be in the"
                    " tree"
                )
            parents.append(index[p[:-1]] if len(p) > 1 else 0)
        mask, depths, retrieve = _masks_from_parents(parents)
        cand = torch.tensor(
            [0] + [p[-1] + top_k * (len(p) - 1) + 1 for p in norm], dtype=torch.long
        )
        return cls(
            norm, top_k, mask, depths, torch.tensor(parents, dtype=torch.long), retrieve, cand
        )

    @property
    def num_nodes(self) -> int:
        """Nodes including the root."""
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        """Longest path length (number of drafted tokens on it)."""
        return int(self.depths.max())

    def build(self, root_token: int, head_topk: torch.Tensor) -> DraftTree:
        """Fill the tree: ``head_topk [K, top_k]`` token ids of every head's top-k (best first)."""
        if head_topk.shape[0] < self.depth or head_topk.shape[1] < self.top_k:
            raise ValueError(
                f"tree needs {self.depth} heads x top-{self.top_k}; got {tuple(head_topk.shape)}"
            )
        flat = torch.cat(
            [
                torch.tensor([root_token], dtype=torch.long, device=head_topk.device),
                head_topk[:, : self.top_k].reshape(-1).long(),
            ]
        )  # [1 + K*top_k]
        tokens = flat[self.candidate_index.to(flat.device)]  # [N+1]
        return DraftTree(tokens, self.parents, self.depths, self.tree_mask, self.retrieve_indices)
