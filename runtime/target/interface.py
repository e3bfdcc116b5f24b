"""The one interface of a runtime target: what the decoding loops, the proposers and the bench may ask of it.

The lean decoder (:class:`~draftsmith.runtime.target.model.LeanDecoder`), the family decoders built by it
(:class:`~draftsmith.runtime.target.family_decoder.FamilyDecoder`), the transformers fallback
(:class:`~draftsmith.runtime.target.hf.HFModelAdapter`) and Kangaroo's cache-sharing wrapper all subclass
:class:`TargetDecoder`; ``tests/test_target_kinds.py`` runs every kind through the plain and speculative loops with
both LM heads against HF greedy ``generate``. Batch 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from draftsmith.runtime.target.output import TargetOutput

HEADS = ("logits", "argmax")  # what a forward's LM head returns: [T', V] logits, or each row's argmax [T']


class RuntimeCache(Protocol):
    """What the decoding loops need from a decoder's KV cache: ``length`` committed slots of ``max_len``."""

    length: int
    max_len: int

    def commit(self, n: int) -> None: ...
    def compact(self, src_slots: torch.Tensor, dst_start: int | None = None) -> None: ...
    def crop(self, length: int) -> None: ...


class TargetDecoder:
    """A frozen target as the runtime serves it (see the module docstring).

    Declared members, with what each kind supports:
    - ``config`` (lean :class:`~draftsmith.runtime.target.model_config.ModelConfig` or a transformers config: both
      have ``max_position_embeddings``, ``vocab_size``, ``hidden_size``), ``dtype``, ``device``, ``lm_head_weight``
      [V, H] and ``embed_weight`` [V, H] (read-only by convention);
    - :meth:`allocate_cache` and :meth:`forward` (tree mask, positions, rows, taps, head);
    - ``argmax_head``: ``forward(head="argmax")`` is the cheaper greedy head, so greedy loops ask for it (every kind
      accepts ``head="argmax"``; the fallback takes the argmax of its logits, the same tokens);
    - ``layer_range``: the layer-range API a self-drafter needs (``embed_tokens``, ``forward_layers``,
      ``final_hidden``, ``lm_head_logits``; Kangaroo), the lean kinds only;
    - :meth:`check_speculative`: refuses (one line) before any work when draft trees cannot be verified exactly.
    """

    config: Any
    dtype: torch.dtype
    device: torch.device
    lm_head_weight: torch.Tensor
    embed_weight: torch.Tensor
    argmax_head: bool = False
    layer_range: bool = False

    def allocate_cache(self, max_len: int) -> RuntimeCache:
        """A KV cache of ``max_len`` slots (batch 1)."""
        raise NotImplementedError(f"{type(self).__name__} must define allocate_cache()")

    def forward(self, input_ids: torch.Tensor, cache: Any, tree_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, logits_for: str | torch.Tensor = "all", taps: Sequence[int] = (),
                head: str = "logits") -> TargetOutput:
        """Run T new tokens ``input_ids`` [T] after the cache's committed prefix (their K/V are written, not
        committed). ``tree_mask`` [T, T] bool (None = causal); ``positions`` [T] (default: the next slots);
        ``logits_for``: "all", "last" or row indices; ``taps``: decoder-layer inputs to return; ``head``: "logits"
        or "argmax" (:data:`HEADS`). See :meth:`draftsmith.runtime.target.model.LeanDecoder.forward`."""
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    def check_speculative(self) -> None:
        """Raise (one line) when this target cannot verify draft trees exactly; the lean kinds always can."""


def check_head(head: str) -> None:
    """Refuse a ``head`` other than those in :data:`HEADS`."""
    if head not in HEADS:
        raise ValueError(f"head must be 'logits' or 'argmax', got {head!r}")


__all__ = ["HEADS", "RuntimeCache", "TargetDecoder", "check_head"]
