"""The one interface of a runtime target: every member the decoding loops, the proposers, the bench
and batched generation may use, declared with its default, so nothing outside ``runtime/target/``
probes a target (``tests/test_seams_runtime.py`` fails on a ``getattr``/``hasattr`` of one).

The lean decoder (:class:`~draftsmith.runtime.target.model.LeanDecoder`), the family decoders built
by it (:class:`~draftsmith.runtime.target.family_decoder.FamilyDecoder`), the transformers fallback
(:class:`~draftsmith.runtime.target.hf.HFModelAdapter`) and wrappers (:class:`TargetWrapper`:
Kangaroo's cache-sharing one) all subclass :class:`TargetDecoder`; ``tests/test_target_kinds.py``
runs every kind through the plain and speculative loops with both LM heads against HF greedy
``generate``. Batch 1, except :meth:`TargetDecoder.decode_rows` (one new token in each of several
rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.runtime.target.output import TargetOutput

if TYPE_CHECKING:
    from draftsmith.runtime.target.linear_ops import LinearPlan, PackedLinear
    from draftsmith.runtime.target.rows import RowsCache

HEADS = (
    "logits",
    "argmax",
)  # what a forward's LM head returns: [T', V] logits, or each row's argmax [T']


class RuntimeCache(Protocol):
    """What the decoding loops need from a decoder's KV cache: ``length`` committed slots of
    ``max_len``."""

    length: int
    max_len: int

    def check_fits(self, new_tokens: int) -> None: ...
    def commit(self, n: int) -> None: ...
    def compact(self, src_slots: torch.Tensor, dst_start: int | None = None) -> None: ...
    def crop(self, length: int) -> None: ...


@dataclass(frozen=True)
class TargetSizes:
    """A target's sizes, read once from its lean or transformers config (the one place that knows
    both spellings: ``num_layers`` / ``num_hidden_layers``, ``num_kv_heads`` /
    ``num_key_value_heads``, ...)."""

    num_layers: int
    hidden_size: int
    vocab_size: int  # the config's (the embedding may hold padding rows beyond it)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # max_position_embeddings: positions the model was trained on; None = not stated
    context_length: int | None


class TargetDecoder(nn.Module):
    """A frozen target as the runtime serves it (see the module docstring). Every member callers may
    use:

    - ``config`` (lean :class:`~draftsmith.runtime.target.model_config.ModelConfig` or a
      transformers config; read sizes through :attr:`sizes`), ``dtype``, ``device``,
      ``lm_head_weight`` [V, H] and ``embed_weight`` [V, H] (read-only by convention),
      :attr:`sizes`;
    - :meth:`allocate_cache` and :meth:`forward` (tree mask, positions, rows, taps, head);
      :meth:`check_speculative` refuses (one line) before any work when draft trees cannot be
      verified exactly;
    - ``argmax_head``: ``forward(head="argmax")`` is the cheaper greedy head, so greedy loops ask
      for it (every kind accepts ``head="argmax"``; the fallback takes the argmax of its logits, the
      same tokens);
    - the drafters' view of the head: :meth:`lm_head_logits` (the target's own fast linears where it
      has them) and :attr:`packed_head` (the fused C++ kernel's packed head, shared with EAGLE-1's
      native top-k; None elsewhere);
    - what runs, for reports: ``kernel_backend`` (attention / KV kernels), ``linear_plan`` and
      :attr:`linear_ops`;
    - ``layer_range``: the layer-range API a self-drafter needs (:meth:`embed_tokens`,
      :meth:`forward_layers`, :meth:`final_hidden`, :meth:`layer_weights`,
      :meth:`allocate_layer_cache`; Kangaroo), the lean kinds only;
    - :meth:`rows_refusal` / :meth:`allocate_rows` / :meth:`decode_rows`: greedy decoding of several
      rows at once (batched regeneration), the plain lean decoder only;
    - :attr:`decoder_layers`: the decoder layers' weights as a module, for the bench's
      bytes-per-step floor.
    """

    config: object
    argmax_head: bool = False
    layer_range: bool = False
    kernel_backend: str = (
        "n/a"  # "auto" | "torch" | "triton" where the target runs the runtime's kernels
    )
    # how the lean decoder runs its linears (None: transformers runs them)
    linear_plan: LinearPlan | None = None

    # ---- what it is ------------------------------------------------------------------------------
    @property
    def sizes(self) -> TargetSizes:
        """Layer count, widths, vocabulary and context (see :class:`TargetSizes`)."""
        raise NotImplementedError(f"{type(self).__name__} must define sizes")

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head_weight.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head [V, H] (the embedding itself when tied); read-only by convention."""
        raise NotImplementedError(f"{type(self).__name__} must define lm_head_weight")

    @property
    def embed_weight(self) -> torch.Tensor:
        """The token embedding [V, H]; read-only by convention."""
        raise NotImplementedError(f"{type(self).__name__} must define embed_weight")

    @property
    def linear_ops(self) -> str:
        """The linear backend in use for reports: "cpp:avx512_bf16", "cpp:avx2", "mkldnn", "dense"
        or "hf"."""
        return self.linear_plan.label if self.linear_plan is not None else "hf"

    @property
    def packed_head(self) -> PackedLinear | None:
        """The LM head packed for the fused C++ kernel (EAGLE-1's native top-k shares it); None
        elsewhere."""
        return None

    @property
    def decoder_layers(self) -> nn.Module | None:
        """The decoder layers' weights as one module (the bench's byte floor); None when they are
        not separable."""
        return None

    # ---- decoding --------------------------------------------------------------------------------
    def allocate_cache(self, max_len: int) -> RuntimeCache:
        """A KV cache of ``max_len`` slots (batch 1)."""
        raise NotImplementedError(f"{type(self).__name__} must define allocate_cache()")

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
        """Run T new tokens ``input_ids`` [T] after the cache's committed prefix (their K/V are
        written, not committed). ``tree_mask`` [T, T] bool (None = causal); ``positions`` [T]
        (default: the next slots);
        ``logits_for``: "all", "last" or row indices; ``taps``: decoder-layer inputs to return;
        ``head``: "logits" or "argmax" (:data:`HEADS`). See
        :meth:`draftsmith.runtime.target.model.LeanDecoder.forward`.
        """
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    def check_speculative(self) -> None:
        """Raise (one line) when this target cannot verify draft trees exactly; the lean kinds
        always can."""

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on post-norm hidden states [..., H] -> logits [..., V] (drafters that draft
        through the target's head: EAGLE-1, Clover-2, DFlash, Kangaroo)."""
        return F.linear(hidden.to(self.dtype), self.lm_head_weight)

    # ---- layer ranges (``layer_range``: the lean kinds) ------------------------------------------
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the residual stream entering layer 0 [T, H]."""
        raise NotImplementedError(_no_layer_range(self))

    def forward_layers(
        self,
        hidden: torch.Tensor,
        cache: RuntimeCache,
        first: int,
        last: int,
        tree_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decoder layers ``first..last-1`` on the residual stream [T, H] of T new tokens after
        ``cache.length``."""
        raise NotImplementedError(_no_layer_range(self))

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm on a residual stream [T, H]."""
        raise NotImplementedError(_no_layer_range(self))

    def layer_weights(self, first: int, last: int) -> tuple[nn.Module, ...]:
        """The weight objects of decoder layers ``first..last-1`` (shared, not copied)."""
        raise NotImplementedError(_no_layer_range(self))

    def allocate_layer_cache(self, num_layers: int, max_len: int) -> RuntimeCache:
        """A KV cache of the first ``num_layers`` layers only, ``max_len`` slots."""
        raise NotImplementedError(_no_layer_range(self))

    # ---- several rows at once (batched regeneration) ---------------------------------------------
    def rows_refusal(self) -> str | None:
        """Why this target cannot decode several rows at once (None: :meth:`decode_rows` runs)."""
        return (
            f"the {type(self).__name__} decoder has no batched step (the plain lean Llama layer"
            " has)"
        )

    def allocate_rows(self, rows: int, max_len: int) -> RowsCache:
        """A ragged KV cache of ``rows`` rows of ``max_len`` slots each."""
        raise NotImplementedError(self.rows_refusal())

    def decode_rows(self, tokens: torch.Tensor, cache: RowsCache, lo: int, hi: int) -> torch.Tensor:
        """Feed ``tokens[lo:hi]`` (one per row) at each row's next slot; returns each row's greedy
        next token [hi-lo] (rows ``lo..hi-1``' lengths are NOT advanced)."""
        raise NotImplementedError(self.rows_refusal())


class TargetWrapper(TargetDecoder):
    """A target around another (Kangaroo's cache-sharing verifier): every declared member is the
    inner target's unless the wrapper overrides it."""

    def __init__(self, inner: TargetDecoder) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.argmax_head, self.layer_range = inner.argmax_head, inner.layer_range
        self.kernel_backend, self.linear_plan = inner.kernel_backend, inner.linear_plan

    sizes = property(lambda self: self.inner.sizes)
    dtype = property(lambda self: self.inner.dtype)
    device = property(lambda self: self.inner.device)
    lm_head_weight = property(lambda self: self.inner.lm_head_weight)
    embed_weight = property(lambda self: self.inner.embed_weight)
    packed_head = property(lambda self: self.inner.packed_head)
    decoder_layers = property(lambda self: self.inner.decoder_layers)

    def allocate_cache(self, max_len: int) -> RuntimeCache:
        """The inner target's cache."""
        return self.inner.allocate_cache(max_len)

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
        """The inner target's forward."""
        return self.inner.forward(input_ids, cache, tree_mask, positions, logits_for, taps, head)

    def check_speculative(self) -> None:
        """The inner target's check."""
        self.inner.check_speculative()

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The inner target's head."""
        return self.inner.lm_head_logits(hidden)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The inner target's embedding."""
        return self.inner.embed_tokens(input_ids)

    def forward_layers(
        self,
        hidden: torch.Tensor,
        cache: RuntimeCache,
        first: int,
        last: int,
        tree_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The inner target's layer range."""
        return self.inner.forward_layers(hidden, cache, first, last, tree_mask, positions)

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The inner target's final norm."""
        return self.inner.final_hidden(x)

    def layer_weights(self, first: int, last: int) -> tuple[nn.Module, ...]:
        """The inner target's layers."""
        return self.inner.layer_weights(first, last)

    def allocate_layer_cache(self, num_layers: int, max_len: int) -> RuntimeCache:
        """The inner target's layer cache."""
        return self.inner.allocate_layer_cache(num_layers, max_len)


def _no_layer_range(target: TargetDecoder) -> str:
    return (
        f"the {type(target).__name__} target has no layer-range forward (layer_range is False):"
        " load the target with the lean decoder (--backend lean)"
    )


def check_head(head: str) -> None:
    """Refuse a ``head`` other than those in :data:`HEADS`."""
    if head not in HEADS:
        raise ValueError(f"head must be 'logits' or 'argmax', got {head!r}")


__all__ = ["HEADS", "RuntimeCache", "TargetDecoder", "TargetSizes", "TargetWrapper", "check_head"]
