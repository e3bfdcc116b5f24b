"""The transformers fallback's KV cache: a transformers ``DynamicCache`` behind the runtime's
static-cache interface (``length``, ``commit``, ``compact``, ``crop``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from draftsmith.runtime.target.cache import CacheFullError, CommitMixin


class HFCache(CommitMixin):
    """A transformers ``DynamicCache`` behind the static-cache interface.

    The DynamicCache grows by T on every forward; ``length`` counts what the caller kept, and the
    next forward first crops the DynamicCache back to ``length``. Compaction gathers the kept slots.
    """

    def __init__(self, max_len: int) -> None:
        from transformers import DynamicCache

        # No config on purpose: plain full-attention layers that can be cropped/gathered
        # (sliding-window layers keep a rolling buffer that cannot); the model's own mask logic
        # still applies windows.
        self.dc = DynamicCache()
        self.max_len = max_len
        self.length = 0

    def check_fits(self, new_tokens: int) -> None:
        """Raise CacheFullError unless ``new_tokens`` more tokens fit."""
        if self.length + new_tokens > self.max_len:
            raise CacheFullError(
                f"{new_tokens} new tokens do not fit: the cache holds {self.length} of"
                f" {self.max_len} slots; allocate a larger cache or shorten the prompt /"
                " max_new_tokens"
            )

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every layer's K and V [1, Hkv, S, d] by ``fn`` of them."""
        if hasattr(
            self.dc, "layers"
        ):  # transformers >= 4.56: per-layer objects holding .keys / .values
            for layer in self.dc.layers:
                if getattr(layer, "keys", None) is not None and layer.keys.numel():
                    layer.keys, layer.values = fn(layer.keys), fn(layer.values)
        else:  # older transformers: parallel lists
            self.dc.key_cache = [fn(k) for k in self.dc.key_cache]
            self.dc.value_cache = [fn(v) for v in self.dc.value_cache]

    def sync(self) -> None:
        """Drop uncommitted slots (those past ``length``) before the next forward."""
        if self.dc.get_seq_length() > self.length:
            self._map(lambda t: t[:, :, : self.length])  # [1, Hkv, length, d]

    def compact(self, src_slots: torch.Tensor, dst_start: int | None = None) -> None:
        """Keep slots ``0..dst_start-1`` then ``src_slots`` (ascending); the length becomes
        ``dst_start + n``."""
        dst = self.length if dst_start is None else dst_start
        if dst > self.length:
            raise ValueError(
                f"dst_start {dst} is past the committed length {self.length}; that would leave"
                " a gap"
            )
        keep = torch.cat([torch.arange(dst), src_slots.cpu().long()])
        self._map(lambda t: t.index_select(2, keep.to(t.device)))
        self.length = dst + int(src_slots.numel())

    def crop(self, length: int) -> None:
        """Roll back to the first ``length`` committed tokens."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length must be in 0..{self.length}, got {length}")
        self.length = length


__all__ = ["HFCache"]
