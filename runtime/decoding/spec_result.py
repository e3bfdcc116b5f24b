"""What a speculative generation returns (:class:`SpecResult`) and the record that builds it step by
step (:class:`GenerationRecord`): the tokens emitted up to the limit or the first eos (streamed as
soon as they are final), and per step the drafted tokens accepted, the tree size and its depth."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from draftsmith.runtime.decoding import metrics
from draftsmith.runtime.drafting.tree import DraftTree


@dataclass
class SpecResult:
    """Output of :meth:`~draftsmith.runtime.decoding.speculative.SpeculativeDecoder.generate`."""

    tokens: list[int]  # generated tokens (prompt excluded), truncated at eos / max_new_tokens
    steps: int  # target forwards after the prefill (one per verified tree)
    accepted_per_step: list[int]  # drafted tokens accepted at every step (before truncation)
    acceptance_by_position: list[
        float
    ]  # [D]: metrics.acceptance_by_position (cumulative, per drafted depth)
    lossless: bool = True  # False when the verifier is lossy (typical acceptance)
    tree_sizes: list[int] = field(default_factory=list)  # nodes per verified tree (root included)
    depths: list[int] = field(default_factory=list)  # deepest draft position of each step's tree

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target forward
        (:func:`draftsmith.runtime.decoding.metrics.tau`)."""
        return metrics.tau(self.accepted_per_step)


@dataclass
class GenerationRecord:
    """One generation's emitted tokens and per-step statistics, as they accumulate."""

    limit: int  # max_new_tokens
    eos: set[int]
    stream: Callable[[list[int]], None] | None
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted per step
    sizes: list[int] = field(default_factory=list)  # nodes per verified tree
    depths: list[int] = field(default_factory=list)  # deepest draft position per tree

    def emit(self, new: list[int]) -> bool:
        """Append ``new`` up to the limit / first eos; return True when generation is over."""
        chunk = []
        for t in new:
            if len(self.tokens) >= self.limit:
                break
            self.tokens.append(t)
            chunk.append(t)
            if t in self.eos:
                break
        if self.stream is not None and chunk:
            self.stream(chunk)
        return len(self.tokens) >= self.limit or (bool(self.tokens) and self.tokens[-1] in self.eos)

    def step(self, num_accepted: int, tree: DraftTree) -> None:
        """Record one verified tree: its accepted drafted tokens, its size and its depth."""
        self.accepted.append(num_accepted)
        self.sizes.append(tree.num_nodes)
        self.depths.append(int(tree.depths.max()))

    def result(self, lossless: bool) -> SpecResult:
        """The generation's :class:`SpecResult`."""
        return SpecResult(
            self.tokens,
            len(self.accepted),
            self.accepted,
            metrics.acceptance_by_position(self.accepted, self.depths),
            lossless,
            self.sizes,
            self.depths,
        )
