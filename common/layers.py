"""Decoder-layer building blocks any drafter or head may use: RMSNorm, RoPE, attention over a draft
KV cache, SwiGLU.

Written here rather than imported from transformers so an export does not depend on a transformers
version; the math is the Llama one (RMSNorm in fp32, rotate-half RoPE, SiLU-gated MLP).
``DraftAttention`` reads its sizes from a config with ``hidden_size``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim`` and ``rope_theta`` fields (an EAGLE config, or any dataclass
that has them). The KV cache API is documented in ``draftsmith.drafters.eagle``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, cast back, scale."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[B, S, head_dim]`` for integer ``positions`` [B, S] (rotate-half layout)."""
    freqs = positions[..., None].float() * _inv_freq(
        head_dim, float(theta), positions.device
    )  # [B, S, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, S, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


@lru_cache(maxsize=16)
def _inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """RoPE's inverse frequencies [head_dim/2], computed once per shape: a drafting step is a few
    rows, and rebuilding this table cost about as much as applying it. Built outside inference mode,
    so that a table first made while decoding is still an ordinary tensor when training uses it."""
    with torch.inference_mode(False), torch.no_grad():
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, n, S, d] by the tables [B, S, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, S, d]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass
class KVCache:
    """Keys/values of the draft layer, ``[B, n_kv, S, head_dim]`` each, RoPE applied. Immutable by
    convention."""

    key: torch.Tensor
    value: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.key.shape[2])

    def append(self, key: torch.Tensor, value: torch.Tensor) -> KVCache:
        """A new cache with ``key``/``value`` [B, n_kv, S', d] after the current entries."""
        return KVCache(torch.cat((self.key, key), dim=2), torch.cat((self.value, value), dim=2))

    def crop(self, length: int) -> KVCache:
        """The first ``length`` entries (drop rejected speculative entries)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a draft KV cache of length {self.length} to {length}")
        return KVCache(self.key[:, :, :length], self.value[:, :, :length])

    def select(self, index: torch.Tensor) -> KVCache:
        """Keep the entries at ``index`` [S'] in that order (e.g. prefix + the accepted tree
        path)."""
        return KVCache(self.key.index_select(2, index), self.value.index_select(2, index))


def build_attention_mask(
    num_new: int,
    past: int,
    device: torch.device,
    tree_mask: torch.Tensor | None = None,
    key_padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool mask ``[B|1, 1, S, P+S]`` (True = attend) for ``S`` new queries over ``P`` cached +
    ``S`` new keys.

    Without ``tree_mask``: every cached key, and the new keys causally. ``tree_mask`` ``[S, S]``
    replaces the causal pattern among the new keys (all cached keys stay visible); ``[S, P+S]``
    gives full control, e.g. an EAGLE-2 tree expansion whose nodes may only see their own ancestors
    among earlier draft entries. ``key_padding`` [B, P+S] (1 = real token) hides padding keys. Every
    query always sees itself so no row is empty (padding queries then produce finite garbage that
    the losses mask out).
    """
    if tree_mask is None:
        new = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()
        mask = torch.cat((torch.ones(num_new, past, dtype=torch.bool, device=device), new), dim=1)
    elif tuple(tree_mask.shape) == (num_new, num_new):
        mask = torch.cat(
            (
                torch.ones(num_new, past, dtype=torch.bool, device=device),
                tree_mask.to(device=device, dtype=torch.bool),
            ),
            dim=1,
        )
    elif tuple(tree_mask.shape) == (num_new, past + num_new):
        mask = tree_mask.to(device=device, dtype=torch.bool)
    else:
        raise ValueError(
            f"tree_mask must be [{num_new}, {num_new}] or [{num_new}, {past + num_new}] (new"
            f" queries x new or all keys), got {tuple(tree_mask.shape)}"
        )
    mask = mask[None, None]  # [1, 1, S, P+S]
    if key_padding is not None:
        mask = mask & key_padding.bool()[:, None, None, :]  # [B, 1, S, P+S]
    eye = torch.zeros(num_new, past + num_new, dtype=torch.bool, device=device)
    eye[:, past:] = torch.eye(num_new, dtype=torch.bool, device=device)
    return mask | eye[None, None]


def check_attention_shape(config: Any) -> None:
    """Fill ``head_dim`` (0 = hidden_size // num_attention_heads) and check the GQA grouping of a
    drafter config."""
    if config.head_dim == 0:
        config.head_dim = config.hidden_size // config.num_attention_heads
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({config.num_key_value_heads})"
        )


class DraftAttention(nn.Module):
    """Llama GQA self-attention (no biases) whose q/k/v read ``in_features`` inputs, with a KV
    cache."""

    def __init__(self, config: Any, in_features: int) -> None:
        super().__init__()
        self.config = config
        c = config
        self.q_proj = nn.Linear(in_features, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def project(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, S, in], positions [B, S] -> (q [B, nh, S, d], k [B, nkv, S, d], v [B, nkv, S, d]),
        RoPE on q and k."""
        c = self.config
        bsz, seq, _ = x.shape
        # [B, nh, S, d]
        q = self.q_proj(x).view(bsz, seq, c.num_attention_heads, c.head_dim).transpose(1, 2)
        # [B, nkv, S, d]
        k = self.k_proj(x).view(bsz, seq, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, KVCache]:
        """x [B, S, in], positions [B, S], mask [B|1, 1, S, P+S] bool (None: every key, e.g. one new
        query) -> (out [B, S, H], cache incl. the new keys)."""
        c = self.config
        bsz, seq, _ = x.shape
        q, k, v = self.project(x, positions)
        cache = KVCache(k, v) if cache is None else cache.append(k, v)
        groups = c.num_attention_heads // c.num_key_value_heads
        if torch.is_grad_enabled():  # training: the path the recipes were tuned with
            keys = cache.key.repeat_interleave(groups, dim=1)  # [B, nh, P+S, d]
            values = cache.value.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, nh, S, d]
        # drafting: SDPA's own GQA reads the cache without copying it `groups` times (the same
        # output bits)
        else:
            out = F.scaled_dot_product_attention(
                q, cache.key, cache.value, attn_mask=mask, enable_gqa=groups > 1
            )  # [B, nh, S, d]
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1)), cache


class SwiGLU(nn.Module):
    """Llama MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama decoder layer (pre-norm attention + SwiGLU, HF parameter names, so a target's layer
    loads into it)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = DraftAttention(config, h)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = SwiGLU(h, config.intermediate_size)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: KVCache | None
    ) -> tuple[torch.Tensor, KVCache]:
        """x [B, S, H] -> (x [B, S, H], cache incl. the new keys)."""
        attn, cache = self.self_attn(self.input_layernorm(x), positions, mask, cache)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), cache


def default_positions(batch: int, seq: int, start: int, device: torch.device) -> torch.Tensor:
    """Positions ``start .. start+seq-1`` for every row, [B, S]."""
    return torch.arange(start, start + seq, device=device).expand(batch, seq)
