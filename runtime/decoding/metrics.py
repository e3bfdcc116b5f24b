"""The one definition of tau and of acceptance by position, used by speculative results and the
bench alike."""

from __future__ import annotations

from collections.abc import Sequence


def tau(accepted_per_step: Sequence[int]) -> float:
    """Mean accepted length: tokens emitted per verifying target forward, i.e. accepted drafts + the
    target's bonus token, averaged over steps (1.0 when nothing is ever accepted; 0.0 for no
    steps)."""
    return (
        sum(a + 1 for a in accepted_per_step) / len(accepted_per_step) if accepted_per_step else 0.0
    )


def acceptance_by_position(accepted_per_step: Sequence[int], depths: Sequence[int]) -> list[float]:
    """Cumulative acceptance by draft position: entry d-1 = P(draft position d is accepted | the
    step's tree drafted position d), i.e. the share of those steps that accepted at least d tokens.
    Non-increasing in d when every step drafts the same depth. ``depths[i]`` is the deepest position
    step i drafted."""
    if len(accepted_per_step) != len(depths):
        raise ValueError(f"{len(accepted_per_step)} accepted counts vs {len(depths)} depths")
    rates = []
    for d in range(1, max(depths, default=0) + 1):
        reached = [a for a, depth in zip(accepted_per_step, depths) if depth >= d]
        rates.append(sum(a >= d for a in reached) / len(reached) if reached else 0.0)
    return rates
