"""DFlash's optional heads: the Markov refinement (previous slot's token -> LM-head input) and the
confidence input.

Markov head (``markov_head.{down,up}.weight``): DFlash drafts every slot of a block in parallel, so
slot ``k`` does not know which token slot ``k-1`` drafted. The head adds a rank-``r`` term
``up(down(embed(t_{k-1})))`` to slot ``k``'s LM-head input (``t_0`` is the verified token), i.e. a
rank-``r`` correction of the logits through the shared LM head. ``up`` starts at zero, so a fresh
head leaves the drafter unchanged. Training uses teacher forcing (``t_{k-1}`` = the target's greedy
token the drafter should have drafted there); serving applies it slot after slot with the token
actually drafted (one [H] x [H, r] x [r, H] product and one LM-head row per slot: cheap).

Confidence head (``confidence_head.{weight,bias}``, a Linear on the drafter module itself): reads
``concat(LM-head input, embed(drafted token))`` of a slot and predicts P(this slot is accepted |
every earlier slot was accepted), trained with BCE on the drafter's greedy token == the target's
greedy token, on slots whose earlier slots all matched (SpecDec++'s conditional label). The product
over slots is the probability the whole prefix is accepted; the runtime cuts the block through
SpecDec++'s stop-policy seam (runtime/drafting/dflash.py).
"""

from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    """Low-rank map embed(previous token) [.., H] -> additive LM-head input term [.., H]."""

    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, hidden_size, bias=False)
        nn.init.zeros_(self.up.weight)  # starts as "no correction"

    def forward(self, prev_embedding: torch.Tensor) -> torch.Tensor:
        """[.., H] -> [.., H] (through rank r)."""
        return self.up(self.down(prev_embedding))


def confidence_input(head_in: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
    """The confidence head's input: ``concat(LM-head input, embed(drafted token))`` [.., 2H]."""
    return torch.cat((head_in, token_embedding), dim=-1)


class RejectLogit(nn.Module):
    """The confidence head as SpecDec++'s acceptance head: state [.., 2H] -> logit of P(rejected) =
    -logit(accept), so :class:`~draftsmith.runtime.acceptance.stop_policies.LearnedStop` applies it
    unchanged."""

    def __init__(self, confidence_head: nn.Linear) -> None:
        super().__init__()
        self.confidence_head = confidence_head

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        """[.., 2H] -> [.., 1]."""
        return -self.confidence_head(state)


__all__ = ["MarkovHead", "RejectLogit", "confidence_input"]
