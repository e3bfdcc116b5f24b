"""The proposer interface (every member the loop, the shape search and the bench may read, declared
with its default) and the step context handed to it. Families register their builders in
:mod:`~draftsmith.runtime.drafting.registry` (``build_proposer`` lives there too).

A family is a module of this package (named in the registry's ``load_families``) with builders
registered for the export methods it serves (``@register_proposer(method)``), and proposers that
subclass :class:`Proposer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from draftsmith.runtime.acceptance.stop_policies import StopPolicy
from draftsmith.runtime.acceptance.verifiers import Acceptance
from draftsmith.runtime.drafting.tree import DraftTree
from draftsmith.runtime.target.interface import TargetDecoder


@dataclass(kw_only=True)
class StepContext:
    """What a proposer is told, one type for every event of a generation (``begin``, ``propose``,
    ``accept``); built with keywords only (eight fields, several of one type: a positional call
    could swap them unnoticed).

    Rows of the target forward that just ran, by event (P = prompt length, a = accepted drafted
    tokens):
    - begin: ``hidden`` [P, H] and ``taps`` [P, k*H] of the prompt, ``logits`` [1, V] at its last
      position;
    - propose: ``hidden`` [H], the row whose logits gave ``root_token``;
    - accept: ``hidden`` [a+1, H], ``taps`` [a+1, k*H] and ``logits`` [a+1, V] at the accepted nodes
      (root first; ``logits`` is None for a proposer that declares ``reads_logits = False``, which
      lets greedy verification reduce the LM head to an argmax per node), and ``acceptance``.
    ``taps`` holds the target layers the proposer declares in ``feature_taps`` (concatenated in that
    order); None for a proposer that declares none.
    """

    # [L+1] prompt + every emitted token; the last one is the root (not yet in the KV cache)
    tokens: torch.Tensor
    root_token: int
    hidden: torch.Tensor
    stop_policy: StopPolicy | None = None
    generator: torch.Generator | None = None
    taps: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    acceptance: Acceptance | None = None


class Proposer:
    """A drafter as the speculative loop, the shape search and the bench see it: every member they
    may read is declared here with its default, so a family overrides what it has and nothing is
    probed.

    Every family subclasses it (``build_proposer`` refuses a builder's result that does not).
    Members, by reader:
    - the loop (``runtime/decoding/speculative.py``): ``max_tree_nodes`` (the KV cache is sized from
      it), ``feature_taps`` (target layers whose inputs ``begin``/``accept`` read in ``ctx.taps``),
      ``reads_logits`` (False: ``accept`` never reads ``ctx.logits``, so greedy verification may
      reduce the LM head to an argmax); ``wrap_target`` (the decoder the loop verifies with: the
      target itself, or Kangaroo's cache-sharing wrapper);
    - the shape search (``runtime/shapes/draft_shapes.py``): ``shape_family`` ("dynamic_tree":
      chains and trees through ``reshape``; "static_tree": trees of one head per depth,
      ``num_heads`` of them; "depth": only the export's own shape, cut at a depth up to
      ``draft_depth``), ``shape_vocab`` (caps a tree's branching), ``shape_max_depth`` (chains
      beyond the search's usual 4, DFlash: block_size - 1) and ``reshape``;
    - the bench: ``draft_plan`` (which parts of a draft call run natively), ``draft_calls`` (drafter
      forwards so far, counted by the proposer itself when ``counts_draft_calls``; otherwise the
      bench counts forwards of its modules) and, for heads that predict several tokens ahead, the
      :class:`LookaheadHeads` capability.
    """

    max_tree_nodes: int = 1
    feature_taps: tuple[int, ...] = ()
    reads_logits: bool = True
    shape_family: str = "depth"
    shape_vocab: int | None = None
    num_heads: int | None = None
    shape_max_depth: int = 0
    draft_depth: int | None = None
    counts_draft_calls: bool = False
    draft_calls: int = 0

    def begin(self, ctx: StepContext) -> None:
        """Start a generation from the prompt's target rows (nothing to prepare by default)."""

    def propose(self, ctx: StepContext) -> DraftTree:
        """Draft a tree rooted at ``ctx.root_token``."""
        raise NotImplementedError(f"{type(self).__name__} must define propose()")

    def accept(self, ctx: StepContext) -> None:
        """Learn what was accepted (``ctx.acceptance``, the target rows at the accepted nodes);
        nothing by default."""

    def wrap_target(self, model: TargetDecoder) -> TargetDecoder:
        """The decoder the speculative loop verifies with: the target itself unless the proposer
        drafts on the target's own layers and cache (Kangaroo)."""
        return model

    def reshape(self, options: dict[str, Any]) -> None:
        """Draft another shape from now on (families whose ``shape_family`` is not "depth" define
        it)."""
        raise ValueError(
            f"{type(self).__name__} drafts its export's shape only"
            f" (shape_family={self.shape_family!r})"
        )

    @property
    def draft_plan(self) -> dict[str, str]:
        """Which parts of a draft call run natively, and why the others do not (empty: nothing to
        report)."""
        return {}


class ProposerWrapper(Proposer):
    """A proposer around another (a learned stop rule, a recorder): it drafts what ``inner`` drafts
    and declares the inner proposer's loop and bench members as its own (shapes stay the export's:
    ``shape_family`` "depth").
    """

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner

    @property
    def max_tree_nodes(self) -> int:  # type: ignore[override]
        return self.inner.max_tree_nodes

    @property
    def feature_taps(self) -> tuple[int, ...]:  # type: ignore[override]
        return tuple(self.inner.feature_taps)

    @property
    def reads_logits(self) -> bool:  # type: ignore[override]
        return self.inner.reads_logits

    @property
    def counts_draft_calls(self) -> bool:  # type: ignore[override]
        return self.inner.counts_draft_calls

    @property
    def draft_calls(self) -> int:  # type: ignore[override]
        return self.inner.draft_calls

    @property
    def draft_plan(self) -> dict[str, str]:
        return self.inner.draft_plan

    def wrap_target(self, model: TargetDecoder) -> TargetDecoder:
        """The inner proposer's target wrapper."""
        return self.inner.wrap_target(model)

    def begin(self, ctx: StepContext) -> None:
        """Start the inner proposer."""
        self.inner.begin(ctx)

    def propose(self, ctx: StepContext) -> DraftTree:
        """The inner proposer's tree."""
        return self.inner.propose(ctx)

    def accept(self, ctx: StepContext) -> None:
        """Pass the verified rows on to the inner proposer."""
        self.inner.accept(ctx)


class LookaheadHeads(Proposer):
    """A proposer whose heads predict several tokens ahead from one target hidden state (Medusa):
    the bench scores each head's top-1 against the target's greedy continuation."""

    def lookahead_top1(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> top-1 target ids [K, T]: head k at position t predicts the token at
        t+k+2."""
        raise NotImplementedError(f"{type(self).__name__} must define lookahead_top1()")


@runtime_checkable
class ReportsVerifyReuse(Protocol):
    """A verify model (what ``wrap_target`` returns) that reuses drafted states in verification
    (Kangaroo's shallow layers): the bench reports what the reuse saved."""

    def verify_reuse(self) -> dict[str, float]:
        """``{"reused_tokens", "verified_tokens", "verify_compute_saved"}`` so far."""
        ...


def module_dtype(module: torch.nn.Module) -> torch.dtype:
    """The floating dtype a drafter module computes in. Its parameters may be gone: the packed bf16
    GEMM (``runtime.target.fast_linear``) swaps linears for buffers and keeps each weight as a plain
    attribute.
    """
    for tensor in module.parameters():
        return tensor.dtype
    for sub in module.modules():
        weight = getattr(sub, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.is_floating_point():
            return weight.dtype
    raise ValueError(
        f"{type(module).__name__} has no floating weights to take a compute dtype from"
    )


def prune_tree(tree: DraftTree, keep: list[bool]) -> DraftTree:
    """The sub-tree of kept nodes (a kept node's parent must be kept)."""
    new_index = {}
    parents, rows = [], []
    for i, k in enumerate(keep):
        if k:
            new_index[i] = len(rows)
            rows.append(i)
            parents.append(-1 if i == 0 else new_index[int(tree.parents[i])])
    idx = torch.tensor(rows, dtype=torch.long)
    q = tree.draft_q[idx] if tree.draft_q is not None else None
    conf = tree.draft_confidence[idx] if tree.draft_confidence is not None else None
    return DraftTree.from_parents(tree.tokens[idx], parents, q, tree.draft_mode, conf)


class NullProposer(Proposer):
    """Drafts nothing: the loop becomes plain autoregressive decoding (one target forward per
    token)."""

    max_tree_nodes = 1

    def propose(self, ctx: StepContext) -> DraftTree:
        """A root-only tree."""
        return DraftTree.chain([ctx.root_token])


__all__ = [
    "LookaheadHeads",
    "NullProposer",
    "Proposer",
    "ProposerWrapper",
    "ReportsVerifyReuse",
    "StepContext",
    "module_dtype",
    "prune_tree",
]
