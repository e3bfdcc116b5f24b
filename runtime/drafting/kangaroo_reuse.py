"""Kangaroo's verify-time reuse of the shallow layers' work: the chain the proposer
(runtime/drafting/kangaroo.py) drafted last with its shallow states, and the decoder wrapper that
verifies it through the deep layers only.

Verification reuses the shallow work (Kangaroo's ``in_features_large``): :class:`KangarooTarget`
wraps the decoder the speculative loop runs; when the loop verifies exactly the chain just drafted,
it runs only layers ``exit_layer..L-1`` on the stored shallow states (their shallow K/V already sit
in the cache slots), so the verify forward costs ``(L - exit_layer) / L`` of a full one. Anything
else (the prefill) is a full forward. A loop that does not run the wrapper still works: the proposer
then keeps the shallow layers' K/V in a private cache of those layers only and every verification is
a full forward (no reuse).

Lossless: the target's KV for every verified token equals a full forward's (same layers, same
slots, same inputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from draftsmith.kernels.verify import target_argmax
from draftsmith.runtime.target.interface import (
    RuntimeCache,
    TargetDecoder,
    TargetWrapper,
    check_head,
)
from draftsmith.runtime.target.output import TargetOutput

if TYPE_CHECKING:
    from draftsmith.runtime.drafting.kangaroo import KangarooProposer


@dataclass
class ShallowDraft:
    """The chain drafted last and its tokens' shallow states (the residual stream entering
    ``exit_layer``)."""

    tokens: torch.Tensor  # [T] root first
    states: torch.Tensor  # [T, H]
    prefix: int  # cache slot of the root


class KangarooTarget(TargetWrapper):
    """The decoder as the speculative loop sees it with a Kangaroo proposer: shares the cache,
    reuses shallow states.

    ``reused_tokens`` / ``verified_tokens`` count verified tree tokens that skipped the shallow
    layers; the verify compute saved is ``exit_layer / num_layers`` of the reused share
    (:meth:`saved_share`).
    """

    def __init__(self, model: TargetDecoder, proposer: KangarooProposer) -> None:
        super().__init__(model)
        # verification reads logits (the reuse path computes them from the deep layers)
        self.argmax_head = False
        self.proposer = proposer
        self.reused_tokens = self.verified_tokens = 0

    def allocate_cache(self, max_len: int) -> RuntimeCache:
        """The decoder's cache, bound to the proposer (it drafts on it)."""
        cache = self.inner.allocate_cache(max_len)
        self.proposer.cache, self.proposer.private = cache, False
        return cache

    def verify_reuse(self) -> dict[str, float]:
        """What the shallow-state reuse saved so far (the bench's ``verify_reuse`` block)."""
        return {
            "reused_tokens": self.reused_tokens,
            "verified_tokens": self.verified_tokens,
            "verify_compute_saved": self.saved_share(),
        }

    def saved_share(self) -> float:
        """Share of the verify forwards' layer work skipped by reusing the shallow states (0 before
        any step)."""
        if self.verified_tokens == 0:
            return 0.0
        return (
            self.reused_tokens
            / self.verified_tokens
            * self.proposer.exit_layer
            / self.proposer.num_layers
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: RuntimeCache,
        tree_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        logits_for: str | torch.Tensor = "all",
        taps: Sequence[int] = (),
        head: str = "logits",
    ) -> TargetOutput:
        """A full forward, or only the deep layers when verifying the chain just drafted on this
        cache."""
        check_head(head)
        draft, self.proposer.pending = self.proposer.pending, None
        exit_layer, last = self.proposer.exit_layer, self.proposer.num_layers
        reusable = (
            draft is not None
            and cache is self.proposer.cache
            and cache.length == draft.prefix
            and torch.equal(input_ids.cpu(), draft.tokens)
            and set(taps) <= {exit_layer, last}
        )
        if draft is not None:  # a verification (the prefill has no draft)
            self.verified_tokens += input_ids.numel()
        if not reusable:
            return self.inner.forward(
                input_ids, cache, tree_mask, positions, logits_for, taps, head
            )
        self.reused_tokens += input_ids.numel()
        deep = self.inner.forward_layers(
            draft.states, cache, exit_layer, last, tree_mask, positions
        )  # [T, H]
        hidden = self.inner.final_hidden(deep)  # [T, H]
        if isinstance(logits_for, str):
            rows = hidden if logits_for == "all" else hidden[-1:]
        else:
            rows = hidden.index_select(0, logits_for.to(hidden.device))
        found = {i: draft.states if i == exit_layer else deep for i in taps}
        logits = self.inner.lm_head_logits(rows)  # [T', V]
        if head == "argmax":
            return TargetOutput(None, hidden, found, target_argmax(logits))
        return TargetOutput(logits, hidden, found)
