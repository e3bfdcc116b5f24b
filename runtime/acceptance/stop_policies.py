"""Stop policies: how deep a proposer drafts (fixed K, drafter confidence, a learned acceptance head)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class StopPolicy(Protocol):
    """Decides when a proposer stops drafting; ``max_depth`` bounds the draft depth.

    A learned acceptance head (SpecDec++) implements this by predicting, from the drafter's state, the probability
    that the next draft token will be rejected, and stopping when it exceeds a threshold.
    """

    max_depth: int

    def should_stop(self, depth: int, confidence: float, state: torch.Tensor | None = None) -> bool:
        """After ``depth`` drafted tokens on a path, whose last has drafter confidence ``confidence`` (its draft
        probability) and drafter ``state`` (e.g. a hidden vector), stop extending this path?"""
        ...


@dataclass
class FixedDepth:
    """Always draft ``max_depth`` tokens (a static tree is truncated to this depth)."""

    max_depth: int = 4

    def should_stop(self, depth: int, confidence: float, state: torch.Tensor | None = None) -> bool:
        """Stop at the fixed depth."""
        return depth >= self.max_depth


@dataclass
class ConfidenceStop:
    """Stop extending a path once the drafter's probability of its last token falls below ``threshold``."""

    threshold: float = 0.3
    max_depth: int = 8

    def should_stop(self, depth: int, confidence: float, state: torch.Tensor | None = None) -> bool:
        """Stop when the last drafted token was unconfident, or at ``max_depth``."""
        return depth >= self.max_depth or confidence < self.threshold


@dataclass
class LearnedStop:
    """Stop when a learned head predicts the next draft token is likely rejected (SpecDec++ style).

    ``head`` maps the drafter state [H] to a logit of P(rejection); stop when sigmoid(logit) >= ``threshold``.
    """

    head: torch.nn.Module
    threshold: float = 0.7
    max_depth: int = 8

    def should_stop(self, depth: int, confidence: float, state: torch.Tensor | None = None) -> bool:
        """Stop at ``max_depth`` or when the head's rejection probability reaches the threshold."""
        if depth >= self.max_depth:
            return True
        if state is None:
            raise ValueError("LearnedStop needs the drafter state; this proposer does not provide one")
        with torch.no_grad():
            return float(torch.sigmoid(self.head(state).reshape(-1)[0])) >= self.threshold
