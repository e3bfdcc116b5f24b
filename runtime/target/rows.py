"""The lean decoder's step over several rows at once: one new token in each row of a ragged KV cache
(batched greedy regeneration, :mod:`draftsmith.datagen.batched_generation`, which owns the
scheduling and calls :meth:`~draftsmith.runtime.target.model.LeanDecoder.decode_rows`).

A 135M target at batch 1 is memory-bound: each step reads every weight to make one token; ``N`` rows
per step read the weights once for ``N`` tokens. Row ``b`` of a :class:`RowsCache` holds
``lengths[b]`` committed slots, no padding; a row's prompt is prefilled by the decoder's own batch-1
forward into :meth:`RowsCache.row` (a view), so each first token is the one batch-1 decoding picks.
A step writes one K/V per row at that row's length and position and attends under a mask of the
row's own slots.

- On the fused C++ stack (bf16 on x86) the whole step is one native call,
  ``TargetStack.forward_rows``: it runs batch-1 decoding's kernels, so its tokens equal batch-1
  ``generate_ar`` bit for bit (tests/test_cpu_stack.py).
- Elsewhere (fp32, torch or oneDNN linears) :func:`rows_layer` runs: the plain Llama layer of
  :mod:`~draftsmith.runtime.target.torch_layers` (its attention inputs and its MLP are the same
  functions) with the K/V write and attention of one token per row. In fp32 it matches batch-1
  decoding token for token (tests/test_batched_regenerate.py); in bf16 its ops round unlike the
  fused layer's, so a greedy reply meeting a near-tie may go on differently (both are the target's
  own greedy text).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from draftsmith.runtime.target.cache import CacheFullError, CommitMixin
from draftsmith.runtime.target.torch_layers import mlp_residual, qk_rope_v

Tensor = torch.Tensor


class RowView(CommitMixin):
    """Batch-1 cache interface over row ``b`` of a :class:`RowsCache` (the decoder's own forward
    prefills into it)."""

    def __init__(self, k: Tensor, v: Tensor, row: int) -> None:
        self.layers = list(
            zip(k[:, row].unbind(0), v[:, row].unbind(0))
        )  # per-layer [Hkv, S, d] views
        self.max_len = k.shape[3]
        self.length = 0

    def check_fits(self, new_tokens: int) -> None:
        """Raise CacheFullError unless ``new_tokens`` more tokens fit in the row."""
        if self.length + new_tokens > self.max_len:
            raise CacheFullError(
                f"{new_tokens} new tokens do not fit in a {self.max_len}-slot batch row"
            )


class RowsCache:
    """K/V ``[L, B, Hkv, S, d]`` of ``B`` rows; ``lengths`` [B] the committed slots of each (its
    next position)."""

    def __init__(
        self,
        num_layers: int,
        rows: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, rows, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, Hkv, S, d]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)  # [B]
        self.max_len = max_len

    def row(self, b: int) -> RowView:
        """An empty batch-1 view of row ``b`` (prefill it with the decoder's forward, then set
        ``lengths[b]``)."""
        return RowView(self.k, self.v, b)


def rows_layer(
    linear: Callable,
    linear_add: Callable,
    weights: tuple,
    x: Tensor,
    kc: Tensor,
    vc: Tensor,
    rows: Tensor,
    slots: Tensor,
    cos: Tensor,
    sin: Tensor,
    mask: Tensor,
    *,
    hq: int,
    hkv: int,
    eps: float,
    scale: float,
) -> Tensor:
    """The plain Llama layer for one new token per row: x [b, H] -> [b, H]; K/V written at
    ``kc[rows, :, slots]``.

    ``kc``/``vc`` [b, Hkv, S', d] (this step's rows and slot window), ``mask`` [b, 1, 1, S'] each
    row's own slots, cos/sin [b, 1, d] at each row's position. ``weights``: the layer's 12-tuple of
    ``LeanDecoder``'s exec plan.
    """
    ln1, wqkv, bqkv, qn, kn, wo, bo, ln2, wgu, bgu, wdown, bdown = weights
    n, d = x.shape[0], kc.shape[-1]
    qk, v = qk_rope_v(
        linear, x, ln1, wqkv, bqkv, qn, kn, cos, sin, hq, hkv, d, eps
    )  # [b, Hq+Hkv, d], [b, Hkv, d]
    kc[rows, :, slots] = qk[:, hq:]  # [b, Hkv, d] into each row's next slot
    vc[rows, :, slots] = v
    # GQA without repeating K/V: the query heads of one kv head are its G query rows (as
    # tree_attention does)
    qg = qk[:, :hq].reshape(n, hkv, hq // hkv, d)  # [b, Hkv, G, d]
    attn = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=mask, scale=scale)  # [b, Hkv, G, d]
    x = linear_add(attn.reshape(n, hq * d), wo, bo, x)  # [b, H]
    return mlp_residual(linear, linear_add, x, ln2, wgu, bgu, wdown, bdown, eps)  # [b, H]


def torch_rows_step(
    layer: Callable,
    weights: list[tuple],
    x: Tensor,
    cache: RowsCache,
    pos: Tensor,
    lo: int,
    hi: int,
    cos: Tensor,
    sin: Tensor,
) -> Tensor:
    """Every layer of the torch rows step on x [b, H] (rows ``lo..hi-1`` at positions ``pos`` [b]);
    returns the residual stream leaving the last layer [b, H]. ``layer``: :func:`rows_layer` with
    its linears and sizes bound.
    """
    window = int(pos.max()) + 1  # attend over the slots any row of the range uses
    rows = torch.arange(hi - lo, device=pos.device)
    mask = (torch.arange(window, device=pos.device)[None, :] <= pos[:, None])[
        :, None, None, :
    ]  # [b, 1, 1, S']
    for i, w in enumerate(weights):
        kc, vc = (
            cache.k[i, lo:hi, :, :window],
            cache.v[i, lo:hi, :, :window],
        )  # [b, Hkv, S', d] views
        x = layer(w, x, kc, vc, rows, pos, cos, sin, mask)  # [b, H]
    return x


class RowsStep:
    """:class:`~draftsmith.runtime.target.interface.TargetDecoder`'s rows members for the plain lean
    decoder (a mixin of :class:`~draftsmith.runtime.target.model.LeanDecoder`: it reads the
    decoder's exec plan, RoPE tables, fused stack and head, so the rows step runs the decoder's own
    weights and kernels)."""

    def rows_refusal(self) -> str | None:
        """Why this decoder cannot decode several rows at once (None: it can)."""
        if self.config.llama_layer_gap is not None:  # a FamilyDecoder runs other layers
            return (
                f"the {type(self).__name__} decoder has no batched step (the plain lean Llama layer"
                " has)"
            )
        if self._compiled is not None:
            return "the decoder is compiled (torch.compile)"
        if self.config.sliding_window is not None:
            return "the model has a sliding window"
        return None

    def allocate_rows(self, rows: int, max_len: int) -> RowsCache:
        """A ragged cache of ``rows`` rows of ``max_len`` slots (RoPE tables grown to reach
        them)."""
        c = self.config
        self._ensure_rope(max_len)
        return RowsCache(
            c.num_layers, rows, c.num_kv_heads, max_len, c.head_dim, self.dtype, self.device
        )

    @torch.inference_mode()
    def decode_rows(self, tokens: Tensor, cache: RowsCache, lo: int, hi: int) -> Tensor:
        """Feed ``tokens[lo:hi]`` [b] at slots ``cache.lengths[lo:hi]``; each row's greedy next
        token [b] (lengths are not advanced): the fused stack's ``forward_rows`` where it runs, else
        :func:`torch_rows_step`.
        """
        why = self.rows_refusal()
        if why is not None:
            raise ValueError(f"batched decoding is unavailable: {why}")
        c, pos = (
            self.config,
            cache.lengths[lo:hi],
        )  # [b]: a row's next slot is its position (no padding)
        x = F.embedding(tokens[lo:hi], self.embed)  # [b, H]
        # every layer, the final norm and the head's argmax in one native call
        if self._stack is not None:
            cos, sin = (
                t[pos].reshape(hi - lo, -1).contiguous() for t in (self._cos, self._sin)
            )  # [b, d]
            return self._stack.stack.forward_rows(
                x.contiguous(), cache.k, cache.v, lo, pos.contiguous(), cos, sin
            )
        layer = partial(
            rows_layer,
            self._ops.linear,
            self._ops.linear_add,
            hq=c.num_heads,
            hkv=c.num_kv_heads,
            eps=c.rms_norm_eps,
            scale=c.head_dim**-0.5,
        )
        x = torch_rows_step(
            layer, self._exec, x, cache, pos, lo, hi, self._cos[pos], self._sin[pos]
        )  # [b, H]
        return self._ops.argmax(self.final_hidden(x), self._head, None)  # [b]: no [b, V] logits


__all__ = ["RowView", "RowsCache", "RowsStep", "rows_layer", "torch_rows_step"]
