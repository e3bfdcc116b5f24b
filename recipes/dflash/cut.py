"""The confidence cut a trained DFlash head serves at, chosen on validation data.

The runtime (runtime/drafting/dflash.py) drafts a whole block, then stops after the first slot at
which the product of the head's per-slot acceptance probabilities falls below ``cut``. A higher cut
verifies fewer tokens and keeps fewer accepted ones. On validation blocks this module counts, for
every cut of :data:`CUT_GRID`, the slots the runtime would verify and the greedy-accepted ones it
would keep, and picks the cut with the most accepted tokens per unit of verify cost, a step costing
``1 + token_cost * verified`` (``inference.cut_token_cost``: what one more drafted token adds to a
verify step, about 0.1 of a step on 2 CPU cores, less on a GPU). Ties keep the smaller cut.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CUT_GRID = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def drafted_per_cut(
    confidence: torch.Tensor, scored: torch.Tensor, cuts: torch.Tensor
) -> torch.Tensor:
    """Slots the runtime verifies per block for each cut: up to and including the first slot whose
    cumulative confidence falls below the cut, at most the block's ``scored`` slots. ``confidence``
    [N, S], ``scored`` [N], ``cuts`` [C] -> [C, N]."""
    below = confidence.cumprod(-1)[None] < cuts[:, None, None]  # [C, N, S]
    first = below.long().argmax(-1) + 1  # [C, N]: 1 + the first slot below the cut
    drafted = torch.where(
        below.any(-1), first, torch.full_like(first, confidence.shape[-1])
    )  # [C, N]
    return torch.minimum(drafted, scored.long()[None])


class CutSearch:
    """Sums, over validation blocks, verified and kept-accepted slots per cut; :meth:`best` picks
    one."""

    def __init__(self, token_cost: float, grid: tuple[float, ...] = CUT_GRID) -> None:
        self.token_cost, self.cuts = float(token_cost), torch.tensor(grid, dtype=torch.float64)
        self.reset()

    def reset(self) -> None:
        self.drafted = torch.zeros(len(self.cuts), dtype=torch.float64)
        self.accepted = torch.zeros(len(self.cuts), dtype=torch.float64)
        self.blocks = torch.zeros((), dtype=torch.float64)

    def add(self, confidence: torch.Tensor, scored: torch.Tensor, accepted: torch.Tensor) -> None:
        """``confidence`` [N, S]: per-slot acceptance probabilities of N blocks; ``scored`` [N]:
        their scored slots (a block near the end of a row has fewer); ``accepted`` [N]: their
        greedy-accepted prefix lengths.
        """
        drafted = drafted_per_cut(confidence.double().cpu(), scored.cpu(), self.cuts)  # [C, N]
        kept = torch.minimum(drafted, accepted.cpu().long()[None])  # [C, N]
        self.drafted += drafted.sum(-1).double()
        self.accepted += kept.sum(-1).double()
        self.blocks += accepted.numel()

    def best(
        self, reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> tuple[float, float] | None:
        """(cut, accepted-per-cost proxy) over everything added (summed over processes by
        ``reduce_sum``); None when no block was seen."""
        drafted, accepted, blocks = self.drafted, self.accepted, self.blocks
        if reduce_sum is not None:
            drafted, accepted, blocks = (reduce_sum(t) for t in (drafted, accepted, blocks))
        if float(blocks) == 0:
            return None
        speed = (blocks + accepted) / (
            blocks + self.token_cost * drafted
        )  # [C]: tokens per verify-step cost
        index = int(torch.nonzero(speed == speed.max())[0])  # the smallest cut among ties
        return float(self.cuts[index]), float(speed[index])
