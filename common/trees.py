"""Medusa-style sparse trees from measured head accuracies (pure functions, no model code).

A tree is a list of paths; path ``[i0, i1, ..., id]`` is the node reached by taking the top-(i0+1)
token of head 0, then the top-(i1+1) token of head 1, and so on (the root, the target's own next
token, is implicit). ``acc[k][i]`` is the probability that the top-(i+1) token of head k is the
right one (each rank counted on its own, so a row sums to head k's top-``top_k`` accuracy). Medusa's
greedy construction (arXiv 2401.10774, section "optimized tree"): a node's expected contribution to
the acceptance length is the product of the accuracies along its path; add the best node until the
budget is spent. A child's product never exceeds its parent's, so the chosen set is a tree.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

import torch


def _check_table(acc: torch.Tensor) -> None:
    if acc.dim() != 2 or acc.shape[0] < 1 or acc.shape[1] < 1:
        raise ValueError(
            f"head accuracies must be a [num_heads, top_k] table, got shape {tuple(acc.shape)}"
        )
    if bool(((acc < 0) | (acc > 1)).any()) or not bool(torch.isfinite(acc).all()):
        raise ValueError("head accuracies must be probabilities in [0, 1]")


def greedy_tree(acc: torch.Tensor | Sequence[Sequence[float]], num_nodes: int) -> list[list[int]]:
    """Medusa's greedy optimal sparse tree for ``acc [K, top_k]`` (probability that top-(i+1) of
    head k is right) with ``num_nodes`` drafted nodes (root excluded), in the order chosen (best
    expected contribution first).

    A path's expected contribution is the product of its accuracies; nodes are added best-first.
    Because a child's product never exceeds its parent's, the chosen set is a tree. Ties go to the
    lexicographically smaller path. The one tree builder: the runtime's default tree and the
    recipes' end-of-training calibration both use it.
    """
    acc = torch.as_tensor(acc, dtype=torch.float64)
    _check_table(acc)
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    num_heads, top_k = acc.shape
    heap = [(-float(acc[0, i]), (i,)) for i in range(top_k)]  # (-value, path): best first
    heapq.heapify(heap)
    chosen: list[list[int]] = []
    while heap and len(chosen) < num_nodes:
        neg, path = heapq.heappop(heap)
        chosen.append(list(path))
        if len(path) < num_heads:  # its children become candidates
            for i in range(top_k):
                heapq.heappush(heap, (neg * float(acc[len(path), i]), (*path, i)))
    return chosen


def calibrated_tree(
    acc: torch.Tensor | Sequence[Sequence[float]], num_nodes: int
) -> list[list[int]]:
    """:func:`greedy_tree` sorted by (depth, ranks), the order exports store."""
    return sorted(greedy_tree(acc, num_nodes), key=lambda p: (len(p), p))


def expected_accept_length(
    tree: Sequence[Sequence[int]], acc: torch.Tensor | Sequence[Sequence[float]]
) -> float:
    """Expected tokens per step under independent heads: 1 (the target's own token) + sum of path
    products."""
    acc = torch.as_tensor(acc, dtype=torch.float64)
    _check_table(acc)
    total = 1.0
    for path in tree:
        value = 1.0
        for depth, rank in enumerate(path):
            value *= float(acc[depth, rank])
        total += value
    return total


class HeadRankStats:
    """Counts, per head, how often the reference token was the head's top-1, top-2, ... (for
    :func:`calibrated_tree`).

    ``update(k, logits [N, V], labels [N])`` after each validation batch; ``accuracies()`` is the
    ``[K, top_k]`` table (None until something was counted). ``counts`` / ``totals`` are plain
    tensors so a caller can sum them across processes before reading.
    """

    def __init__(self, num_heads: int, top_k: int) -> None:
        if num_heads < 1 or top_k < 1:
            raise ValueError(f"num_heads and top_k must be >= 1, got {num_heads}, {top_k}")
        self.top_k = top_k
        self.counts = torch.zeros(num_heads, top_k, dtype=torch.float64)
        self.totals = torch.zeros(num_heads, dtype=torch.float64)

    def reset(self) -> None:
        """Forget everything counted (call at the start of a validation pass)."""
        self.counts.zero_()
        self.totals.zero_()

    @torch.no_grad()
    def update(self, head: int, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Count the rank of ``labels`` [N] among ``logits`` [N, V] for ``head``."""
        if logits.shape[0] == 0:
            return
        k = min(self.top_k, logits.shape[-1])
        top = logits.topk(k, dim=-1).indices  # [N, k]
        # [k]: how often rank i was the label
        hits = (top == labels.unsqueeze(-1)).double().sum(0).cpu()
        self.counts[head, :k] += hits
        self.totals[head] += logits.shape[0]

    @torch.no_grad()
    def update_topk(self, head: int, top: torch.Tensor, labels: torch.Tensor) -> None:
        """Same as :meth:`update` from each row's sorted top-k token ids ``top`` [N, >=1] (a fused
        LM-head loss returns these instead of the logits); ranks beyond ``top``'s width count as
        misses."""
        if top.shape[0] == 0:
            return
        k = min(self.top_k, top.shape[-1])
        hits = (top[:, :k] == labels.unsqueeze(-1)).double().sum(0).cpu()  # [k]
        self.counts[head, :k] += hits
        self.totals[head] += top.shape[0]

    def accuracies(self) -> torch.Tensor | None:
        """``[K, top_k]`` per-rank accuracies, or None when a head has no counted row."""
        if bool((self.totals == 0).any()):
            return None
        return self.counts / self.totals.unsqueeze(-1)


class TreeCalibration:
    """Per-head rank counts from validation and the export tree built from them (or ``fallback``).

    An objective calls ``stats.update(k, logits, greedy)`` on validation batches and forwards the
    DistillModule's ``on_validation_start`` / ``on_validation_end(reduce_sum)`` hooks here;
    ``tree_block()`` goes into the export's inference block.
    """

    def __init__(
        self, num_heads: int, top_k: int, num_nodes: int, fallback: list[list[int]]
    ) -> None:
        self.stats = HeadRankStats(num_heads, top_k)
        self.num_nodes, self.fallback = num_nodes, fallback

    def on_validation_start(self) -> None:
        """Forget earlier passes."""
        self.stats.reset()  # the tree reflects the last validation pass (the end of training)

    def on_validation_end(
        self, reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        """Sum the counts over processes (DDP) when ``reduce_sum`` is given."""
        if reduce_sum is not None:  # sum the counts of every process (DDP)
            self.stats.counts = reduce_sum(self.stats.counts)
            self.stats.totals = reduce_sum(self.stats.totals)

    def tree_block(self) -> dict[str, Any]:
        """``tree`` plus where it came from (and the measured table) for the export's inference
        block."""
        acc = self.stats.accuracies()
        if acc is None:
            return {"tree": self.fallback, "tree_source": "default"}
        return {
            "tree": calibrated_tree(acc, self.num_nodes),
            "tree_source": "calibrated",
            "head_accuracies": [[round(float(a), 5) for a in row] for row in acc],
        }


def tree_from_head_accuracies(
    acc: torch.Tensor | list[list[float]], num_nodes: int
) -> list[list[int]]:
    """Medusa's greedy optimal sparse tree for ``acc [K, top_k]``, best node first (the one builder:
    :func:`draftsmith.common.trees.greedy_tree`, also used by the recipes' end-of-training
    calibration).
    """
    return greedy_tree(acc, num_nodes)


def default_medusa_tree(num_heads: int, num_nodes: int = 12, top_k: int = 4) -> list[list[int]]:
    """A sparse tree for ``num_nodes`` drafted nodes without calibration.

    Uses the greedy construction on assumed accuracies: head k's top-1 is right with probability 0.6
    * 0.8^k and top-(i+1) with that times 0.4^i (typical of trained Medusa heads: accuracy falls
    with depth and rank). The default budget (12 nodes) suits a 2-core CPU, where trees above ~10-16
    nodes become compute-bound.
    """
    if num_heads < 1 or top_k < 1:
        raise ValueError("num_heads and top_k must be >= 1")
    acc = [[0.6 * 0.8**k * 0.4**i for i in range(top_k)] for k in range(num_heads)]
    return tree_from_head_accuracies(
        acc, min(num_nodes, sum(top_k ** (d + 1) for d in range(num_heads)))
    )
