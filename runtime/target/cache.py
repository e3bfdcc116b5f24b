"""Static KV cache of the lean decoder: preallocated layer-stacked K/V, batch 1.

Slots ``0 .. length-1`` hold committed tokens. A forward of T new tokens writes slots ``length ..
length+T-1`` without moving ``length``; the caller then keeps what it accepted with
:meth:`KVCache.commit` (a plain prefix of the new tokens) or :meth:`KVCache.compact` (an arbitrary
ascending subset, e.g. the accepted path of a draft tree).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.common.errors import DraftsmithError
from draftsmith.kernels.kv_compact import compact_kv


class CacheFullError(DraftsmithError, ValueError):
    """The tokens to add do not fit in the static cache; allocate a longer one."""


class CommitMixin:
    """``commit`` shared by the runtime caches: they differ in storage, not in how a forward's
    tokens are kept."""

    length: int

    def check_fits(self, new_tokens: int) -> None:  # pragma: no cover - each cache defines it
        raise NotImplementedError

    def commit(self, n: int) -> None:
        """Keep the first ``n`` tokens written by the last forward (slots ``length ..
        length+n-1``)."""
        if n < 0:
            raise ValueError(f"commit count must be >= 0, got {n}")
        self.check_fits(n)
        self.length += n


class KVCache(CommitMixin):
    """Preallocated K/V for all layers: ``k``, ``v`` are ``[L, Hkv, max_len, d]``; ``length`` is the
    committed count."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        backend: str = "auto",
    ) -> None:
        if max_len < 1:
            raise ValueError(f"cache max_len must be >= 1, got {max_len}")
        shape = (num_layers, num_kv_heads, max_len, head_dim)
        # Ordinary (non-inference) tensors even when allocated under inference_mode, so that
        # compaction or writes made later outside inference_mode are allowed.
        with torch.inference_mode(False):
            self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, Hkv, S, d]
            self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, Hkv, S, d]
        self.layers = list(
            zip(self.k.unbind(0), self.v.unbind(0))
        )  # per-layer [Hkv, S, d] views, made once
        self.max_len = max_len
        self.length = 0
        self.backend = backend

    @property
    def remaining(self) -> int:
        """Free slots after the committed prefix."""
        return self.max_len - self.length

    def check_fits(self, new_tokens: int) -> None:
        """Raise CacheFullError unless ``new_tokens`` more slots fit after ``length``."""
        if self.length + new_tokens > self.max_len:
            raise CacheFullError(
                f"{new_tokens} new tokens do not fit: the cache holds {self.length} of"
                f" {self.max_len} slots; allocate a larger cache (allocate_cache(max_len)) or"
                " shorten the prompt / max_new_tokens"
            )

    def compact(self, src_slots: torch.Tensor, dst_start: int | None = None) -> None:
        """Move slots ``src_slots`` (ascending, each >= dst_start) to ``dst_start ..`` and set the
        length after them.

        ``dst_start`` defaults to the committed length (the usual case: keep the accepted tree path
        after the prefix).
        """
        dst = self.length if dst_start is None else dst_start
        if dst > self.length:
            raise ValueError(
                f"dst_start {dst} is past the committed length {self.length}; that would leave"
                " a gap"
            )
        n = int(src_slots.numel())
        compact_kv(self.k, self.v, src_slots, dst, backend=self.backend)
        self.length = dst + n

    def crop(self, length: int) -> None:
        """Roll back to the first ``length`` committed tokens (e.g. to reuse a prompt prefix)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length must be in 0..{self.length}, got {length}")
        self.length = length

    def reset(self) -> None:
        """Forget every token (the storage is reused, not cleared)."""
        self.length = 0


class TokenBuffer:
    """The token context of one generation (prompt + emitted tokens) in one preallocated tensor,
    batch 1.

    The decoding loop hands its proposer the whole context every step; rebuilding it from Python
    lists cost O(length) per step. Here :meth:`append` writes a step's tokens after the others and
    :meth:`view` is the first ``length`` entries, a view (no copy) that stays valid while the buffer
    only grows; :meth:`crop` rolls back.
    """

    def __init__(self, tokens: Sequence[int] | torch.Tensor, capacity: int) -> None:
        first = torch.as_tensor(tokens, dtype=torch.long).flatten().cpu()  # [P]
        if capacity < first.numel():
            raise ValueError(
                f"a token buffer of capacity {capacity} cannot hold the {first.numel()} initial"
                " tokens"
            )
        self.data = torch.empty(capacity, dtype=torch.long)  # [capacity]
        # the same memory: a slice assignment from a list is one cheap call
        self._host = self.data.numpy()
        self.data[: first.numel()] = first
        self.length = first.numel()

    @property
    def capacity(self) -> int:
        """How many tokens fit in all."""
        return self.data.numel()

    def append(self, tokens: Sequence[int]) -> None:
        """Add ``tokens`` after the current ones; CacheFullError when they do not fit."""
        n = len(tokens)
        if self.length + n > self.capacity:
            raise CacheFullError(
                f"{n} more tokens do not fit in a token buffer holding {self.length} of "
                f"{self.capacity}"
            )
        self._host[self.length : self.length + n] = tokens
        self.length += n

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens (views taken earlier see later appends past
        ``length``)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length must be in 0..{self.length}, got {length}")
        self.length = length

    def view(self) -> torch.Tensor:
        """The tokens so far [length] (a view of the buffer, not a copy)."""
        return self.data[: self.length]
