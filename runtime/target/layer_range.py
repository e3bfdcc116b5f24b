"""The lean decoder's layer ranges (runtime/target/model.py): decoder layers ``first..last-1`` on
the residual stream over the same KV cache. The full forward runs the whole range; a self-drafter
(Kangaroo) runs the target's shallow layers this way, reuses their KV cache, and finishes a forward
with :meth:`~LayerRangeStep.final_hidden` and the LM head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.runtime.target.cache import KVCache


class LayerRangeStep:
    """Mixin of :class:`~draftsmith.runtime.target.model.LeanDecoder`: the layer loop and the
    layer-range API (``forward_layers``, ``embed_tokens``, ``final_hidden``, ``layer_weights``,
    ``allocate_layer_cache``)."""

    # forward_layers, embed_tokens, final_hidden, layer_weights, allocate_layer_cache (Kangaroo)
    layer_range = True

    def _layers(
        self,
        x: torch.Tensor,
        first: int,
        last: int,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        start: int,
        tree_mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        taps: tuple[int, ...] = (),
        found: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Decoder layers ``first..last-1`` on the residual stream x [T, H]; ``kv_layers[i]`` is
        layer i's cache; the input of each layer in ``taps`` is stored in ``found``."""
        c = self.config
        cos, sin = self._rope_rows(start, x.shape[0], positions)  # [T, 1, d]
        hq, hkv, eps, scale = c.num_heads, c.num_kv_heads, c.rms_norm_eps, c.head_dim**-0.5
        # The fused C++ layer and _torch_layer (its reference) share one signature.
        fused = getattr(self._ops, "layer", None)
        layer = fused or self._torch_layer
        if fused is not None:
            tree_mask = None if tree_mask is None else tree_mask.contiguous()
            cos, sin = cos.contiguous(), sin.contiguous()  # [T, 1, d]
        for i in range(first, last):
            if found is not None and i in taps:
                found[i] = x
            kc, vc = kv_layers[i]
            x = layer(
                x, *self._exec[i], kc, vc, start, cos, sin, tree_mask, hq, hkv, eps, scale
            )  # [T, H]
        return x

    def _rope_rows(
        self, start: int, t: int, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, d] of T new tokens: positions start.. or ``positions``."""
        if positions is None:
            return self._cos[start : start + t], self._sin[start : start + t]
        # index_select: one plain gather per table (advanced indexing went through aten::index's
        # general path)
        return self._cos.index_select(0, positions), self._sin.index_select(0, positions)

    def forward_layers(
        self,
        hidden: torch.Tensor,
        cache: KVCache,
        first: int,
        last: int,
        tree_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run only decoder layers ``first..last-1`` (a layer range on the same cache): ``hidden``
        [T, H] is the residual stream entering layer ``first`` (``embed`` output for 0) of T new
        tokens after ``cache.length``; those layers' K/V are written at slots ``cache.length ..``
        (not committed). Returns the residual stream leaving layer ``last-1`` [T, H], before the
        final norm. A self-drafter (Kangaroo) runs the target's shallow layers this way and reuses
        their KV cache; :meth:`final_hidden` and :meth:`lm_head_logits` finish a forward.
        """
        c = self.config
        if not 0 <= first < last <= c.num_layers:
            raise ValueError(
                f"need 0 <= first < last <= {c.num_layers} layers; got first={first}, last={last}"
            )
        if hidden.dim() != 2 or hidden.shape[1] != c.hidden_size:
            raise ValueError(f"hidden must be [T, {c.hidden_size}]; got {tuple(hidden.shape)}")
        cache.check_fits(hidden.shape[0])
        if positions is not None:
            self._ensure_rope(int(positions.max()) + 1)
        with torch.inference_mode():
            return self._layers(
                hidden.to(self.dtype), first, last, cache.layers, cache.length, tree_mask, positions
            )

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the residual stream entering layer 0 [T, H]."""
        return F.embedding(input_ids, self.embed)

    def layer_weights(self, first: int, last: int) -> tuple[nn.Module, ...]:
        """Layers ``first..last-1``' weights (the same objects and storage: Kangaroo's drafter
        shares them)."""
        return tuple(self.layers[first:last])

    def allocate_layer_cache(self, num_layers: int, max_len: int) -> KVCache:
        """A static cache of the first ``num_layers`` layers, ``max_len`` slots (RoPE tables grown
        to reach them)."""
        c = self.config
        self._ensure_rope(max_len)
        return KVCache(
            num_layers,
            c.num_kv_heads,
            max_len,
            c.head_dim,
            self.dtype,
            self.device,
            self.kernel_backend,
        )

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm on a residual stream [T, H] (what :meth:`forward` returns as hidden;
        the C++ norm on the cpp backend, as its one-call forward computes it)."""
        return self._final_norm(x, self.norm_w, self.config.rms_norm_eps)
