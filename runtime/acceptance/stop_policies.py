"""Stop policies: how deep a proposer drafts (fixed K, drafter confidence, a learned acceptance
head).

Every policy reads one :class:`StopContext`, built the same way by every proposer after it drafts a
token on a path: ``depth`` (tokens drafted on the path so far, the new one included), ``confidence``
(the drafter's probability of the new token), ``state`` (the drafter's hidden vector that scored the
new token, when the proposer has one) and ``path`` (a per-path scratch dict a policy may keep
running values in; a proposer gives every branch its own copy). ``should_stop(ctx)`` True means:
keep the new token, draft nothing after it on this path.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch

from draftsmith.common.errors import InputError


@dataclass
class StopContext:
    """What a stop policy sees after a token is drafted at ``depth`` (1 = the first token after the
    root)."""

    depth: int
    confidence: float
    # [H] drafter state that scored the token (None: the proposer has none)
    state: torch.Tensor | None = None
    path: dict[str, Any] = field(
        default_factory=dict
    )  # per-path running values (copied when a path branches)

    def child(
        self, depth: int, confidence: float, state: torch.Tensor | None = None
    ) -> StopContext:
        """The context one token deeper on the same path (the scratch is copied, so siblings do not
        share it)."""
        return StopContext(depth, confidence, state, dict(self.path))


@runtime_checkable
class StopPolicy(Protocol):
    """Decides when a proposer stops drafting; ``max_depth`` bounds the draft depth."""

    max_depth: int

    def should_stop(self, ctx: StopContext) -> bool:
        """Stop extending this path after the token described by ``ctx``?"""
        ...


@dataclass
class FixedDepth:
    """Always draft ``max_depth`` tokens (a static tree is truncated to this depth)."""

    max_depth: int = 4

    def should_stop(self, ctx: StopContext) -> bool:
        """Stop at the fixed depth."""
        return ctx.depth >= self.max_depth


@dataclass
class ConfidenceStop:
    """Stop extending a path once the drafter's probability of its last token falls below
    ``threshold``."""

    threshold: float = 0.3
    max_depth: int = 8

    def should_stop(self, ctx: StopContext) -> bool:
        """Stop when the last drafted token was unconfident, or at ``max_depth``."""
        return ctx.depth >= self.max_depth or ctx.confidence < self.threshold


@dataclass
class LearnedStop:
    """SpecDec++'s rule: stop once the predicted probability that some token of the path is rejected
    exceeds ``h``.

    ``head`` maps the drafter state [H] that scored token i to a logit of P(token i is rejected |
    every token before it accepted). After the token at depth d: stop iff ``1 - prod_{i<=d} (1 -
    sigmoid(head(state_i))) > threshold`` (at d = 1 simply P(reject) > h), or ``d >= max_depth``;
    never before ``min_depth``. The running product lives in ``ctx.path`` so each path of a tree
    keeps its own.
    """

    head: torch.nn.Module
    threshold: float = 0.7
    max_depth: int = 8
    min_depth: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise InputError(f"LearnedStop threshold must be in [0, 1], got {self.threshold}")
        # min > max is allowed: max_depth wins (a capped depth)
        if self.min_depth < 1 or self.max_depth < 1:
            raise InputError(
                f"need min_depth >= 1 and max_depth >= 1, got {self.min_depth}, {self.max_depth}"
            )

    def should_stop(self, ctx: StopContext) -> bool:
        """Apply the rule above (updates ``ctx.path["accept_prob"]``)."""
        if ctx.state is None:
            raise ValueError(
                "LearnedStop needs the drafter state; this proposer does not provide one"
            )
        with torch.no_grad():
            p_reject = float(torch.sigmoid(self.head(ctx.state).reshape(-1)[0]))
        ctx.path["accept_prob"] = ctx.path.get("accept_prob", 1.0) * (1.0 - p_reject)
        if ctx.depth >= self.max_depth:
            return True
        return ctx.depth >= self.min_depth and 1.0 - ctx.path["accept_prob"] > self.threshold


class ProposerHead(torch.nn.Module):
    """Stands in for the acceptance head of a SpecDec++ export when the stop policy is chosen
    without the export's
    folder: the SpecDec++ proposer, which loaded the head with its drafter, swaps in its own head
    before drafting (:func:`bind_learned_head`). Any other proposer reaching it gets a clear
    error."""

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        raise InputError(
            "the learned stop policy reads a SpecDec++ acceptance head, "
            "which this proposer does not have; "
            "pass --drafter a specdecpp export, or use fixed:K / confidence:THRESHOLD"
        )


def bind_learned_head(policy: StopPolicy | None, head: torch.nn.Module) -> StopPolicy | None:
    """``policy`` with ``head`` in place of a :class:`ProposerHead` placeholder (other policies
    unchanged)."""
    if isinstance(policy, LearnedStop) and isinstance(policy.head, ProposerHead):
        return replace(policy, head=head)
    return policy
