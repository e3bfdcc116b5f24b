"""The small pieces the EAGLE serving adapters (runtime/drafting/eagle_models.py) run on: the static
draft KV cache, grouped attention for a few queries, and the head's top-k in torch (the reference
and fallback of the fused kernel's ``norm_linear_topk``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class StaticDraftKV:
    """The draft layer's keys and values in preallocated storage ``[1, n_kv, capacity, d]`` with a
    length counter.

    Drop-in for :class:`draftsmith.common.layers.KVCache` in the runtime (``length``, ``key``,
    ``value``, ``append``, ``crop``), but mutable: ``append`` writes after ``length`` in place (the
    storage doubles when full) and ``crop`` only resets ``length``, where the immutable cache copied
    its whole history with ``torch.cat`` on every drafter call (quadratic over a generation). Both
    return the cache itself, so the proposer's ``cache = cache.crop(n)`` / ``cache.append(k, v)``
    pattern reads the same.
    """

    def __init__(self, like: torch.Tensor, capacity: int = 256) -> None:
        shape = (1, like.shape[1], max(1, capacity), like.shape[3])  # [1, n_kv, capacity, d]
        self._k = torch.empty(shape, dtype=like.dtype, device=like.device)
        self._v = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.length = 0

    @property
    def capacity(self) -> int:
        """Entries that fit before the storage grows."""
        return self._k.shape[2]

    @property
    def key(self) -> torch.Tensor:
        """The keys so far [1, n_kv, length, d] (a view)."""
        return self._k[:, :, : self.length]

    @property
    def value(self) -> torch.Tensor:
        """The values so far [1, n_kv, length, d] (a view)."""
        return self._v[:, :, : self.length]

    def reserve(self, size: int) -> None:
        """Make room for ``size`` entries in all, keeping the current ones (doubling: amortised O(1)
        per entry)."""
        if size > self.capacity:
            grown = StaticDraftKV(self._k, max(size, 2 * self.capacity))
            grown._k[:, :, : self.length] = self.key
            grown._v[:, :, : self.length] = self.value
            self._k, self._v = grown._k, grown._v

    def append(self, key: torch.Tensor, value: torch.Tensor) -> StaticDraftKV:
        """Write ``key``/``value`` [1, n_kv, S, d] after the current entries."""
        end = self.length + key.shape[2]
        self.reserve(end)
        self._k[:, :, self.length : end] = key
        self._v[:, :, self.length : end] = value
        self.length = end
        return self

    def crop(self, length: int) -> StaticDraftKV:
        """Keep the first ``length`` entries (drop this step's speculative ones): only the counter
        moves."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a draft KV cache of length {self.length} to {length}")
        self.length = length
        return self


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``common.layers.RMSNorm`` (normalise in fp32, round to x's dtype, scale) in 3 ops instead of
    7."""
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), None, norm.eps).to(x.dtype)


def grouped_attention(
    q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Softmax attention of q [1, nh, S, d] over key/value [1, nkv, L, d] (query head h reads kv
    head h // (nh/nkv), as SDPA's ``enable_gqa``), mask [1, 1, S, L] bool (True = attend) or None,
    in fp32 -> [1, nh, S, d].

    A drafting step has 1-16 queries: each kv head's group of query heads becomes the rows of one
    batched matmul. bf16 SDPA with GQA took a slow path on CPU (~0.18 ms against ~0.05 ms for one
    query over 200 keys, 2-core Zen 4 under load)."""
    nh, seq, hd = q.shape[1:]
    nkv, length = key.shape[1], key.shape[2]
    # [nkv, g*S, d]: heads kv*g .. kv*g+g-1 share kv head kv
    rows = q[0].reshape(nkv, nh // nkv * seq, hd).float()
    scores = torch.bmm(rows, key[0].float().transpose(1, 2)).mul_(hd**-0.5)  # [nkv, g*S, L]
    if mask is not None:
        scores.view(nkv, -1, seq, length).masked_fill_(~mask[0, 0], float("-inf"))  # [nkv, g, S, L]
    out = torch.bmm(torch.softmax(scores, dim=-1), value[0].float())  # [nkv, g*S, d]
    return out.view(1, nh, seq, hd).to(q.dtype)


def torch_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, ids) [S, k] of logits [S, N]: log_softmax in fp32, then the top k (k = 1: the
    first maximum, as argmax)."""
    logp = F.log_softmax(logits.float(), -1)  # [S, N]
    return logp.max(-1, keepdim=True) if k == 1 else logp.topk(k, dim=-1)


def norm_linear_topk_reference(
    x: torch.Tensor,
    norm_w: torch.Tensor | None,
    eps: float,
    packed_w: torch.Tensor,
    n: int,
    k: int,
    linear: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's ``norm_linear_topk`` in torch (the fallback while a build lacks it; ``linear`` =
    the kernel's packed GEMM): (probs [T, k] fp32 = softmax over all n columns of bf16(rmsnorm(x) @
    W^T) at the top k, ids [T, k] long), by descending logit, the lower index first among equal
    logits."""
    if norm_w is not None:
        x = norm_w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)  # [T, K]
    # [T, n]; + 0.0 turns -0 into +0
    logits = linear(x.contiguous(), packed_w, None, n).float() + 0.0
    # Rank by the logits (probabilities that underflow to 0 would tie), the lower column first among
    # equals: topk's order among equal values is unspecified, so rank one int64 key, the logit's
    # bits made monotonic (negative floats flip) then the column (a full stable sort cost ~1 ms
    # here).
    bits = logits.view(torch.int32)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long() * (1 << 32) - torch.arange(
        n, device=x.device
    )
    ids = key.topk(k, dim=-1).indices  # [T, k]
    probs = torch.softmax(logits, -1)  # [T, n]
    return probs.gather(1, ids), ids


__all__ = [
    "StaticDraftKV",
    "grouped_attention",
    "norm_linear_topk_reference",
    "rms_norm",
    "torch_topk",
]
