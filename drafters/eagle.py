"""EAGLE-1 drafter: one Llama-style decoder layer that extrapolates the target's post-norm feature.

Inputs at pair index ``t`` are the target feature ``f_t`` (post final norm, ``Target`` tap ``final_hidden``)
and the NEXT token ``x_{t+1}``: ``z_t = fc(concat(embed(x_{t+1}), f_t))`` (embedding first), then one decoder
layer without ``input_layernorm`` gives ``f̂_{t+1}`` (no final norm); the target's frozen LM head turns it into
the distribution of ``x_{t+2}``. RoPE position of pair ``t`` is ``t``.

This module also holds the building blocks shared with EAGLE-3 (RMSNorm, RoPE, attention with a KV cache,
SwiGLU MLP). They are written here rather than imported from transformers so an export does not depend on a
transformers version; the math is the Llama one (RMSNorm in fp32, rotate-half RoPE, SiLU-gated MLP).

KV cache API (used by the runtime for incremental drafting)
-----------------------------------------------------------
``KVCache(key, value)`` holds the draft layer's keys/values ``[B, n_kv, S, head_dim]`` (RoPE already applied).
``forward(..., past_kv=cache)`` appends the new pairs after the cache and returns the extended cache; it
never mutates its input, so the runtime can keep the cache of the accepted prefix and throw speculative
entries away with ``cache.crop(n)`` (or keep an accepted tree path with ``cache.select(index)``).
Default positions continue from ``cache.length``; pass ``positions`` explicitly for tree drafting (siblings
share a position) together with ``tree_mask``: ``[S, S]`` bool (True = new query may see new key; all cached
keys visible) or ``[S, P+S]`` (also choose which cached keys each query sees, for EAGLE-2 tree expansion where
the cache holds earlier draft nodes of other branches).

Runtime loop (greedy chain or EAGLE-2 tree): after the target has scored ``x_0..x_n`` (features
``f_0..f_n``) and produced ``x_{n+1}``, prefill the drafter with pairs ``(f_t, x_{t+1})`` for ``t = 0..n`` at
positions ``0..n``; ``logits(pred[:, -1])`` drafts ``x_{n+2}``. A further draft step feeds ``(f̂, x̂)``: the
drafter's own predicted feature with the token drafted from it, at the next position. The target then scores
``x_{n+1}`` and the drafts (features ``f_{n+1}, ...``); when it accepts ``a`` drafts and adds a bonus token
``b``, crop the drafter cache back to the ``n+1`` pairs built from target features and append the pairs
``(f_{n+1}, x_{n+2}), ..., (f_{n+1+a}, b)`` at positions ``n+1 .. n+1+a`` (target features of the tokens
just scored, each paired with the token that follows it); the last output drafts the next round.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.export.format import ExportError, read_export


def _rope_theta(hf_config: Any) -> float:
    """RoPE base of a HF config (transformers 5 keeps it in ``rope_parameters``, older ones in ``rope_theta``)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(hf_config, "rope_theta", 10000.0))


@dataclass
class EagleConfig:
    """Architecture of an EAGLE-1 drafter (sizes follow the target's HF config)."""

    hidden_size: int
    vocab_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def dims_from_hf(cls, hf_config: Any) -> dict[str, Any]:
        """The size fields shared by EAGLE-1 and EAGLE-3, read from a Llama-family HF config."""
        heads = int(hf_config.num_attention_heads)
        return {
            "hidden_size": int(hf_config.hidden_size), "vocab_size": int(hf_config.vocab_size),
            "intermediate_size": int(hf_config.intermediate_size), "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(hf_config, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads),
            "rms_norm_eps": float(getattr(hf_config, "rms_norm_eps", 1e-6)), "rope_theta": _rope_theta(hf_config),
            "max_position_embeddings": int(getattr(hf_config, "max_position_embeddings", 2048)),
        }

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> EagleConfig:
        """Size the drafter like one layer of the target."""
        return cls(**cls.dims_from_hf(hf_config))


# ----------------------------------------------------------------------------------------------------------
# Building blocks (shared with drafters/eagle3.py)
# ----------------------------------------------------------------------------------------------------------


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


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[B, S, head_dim]`` for integer ``positions`` [B, S] (rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions[..., None].float() * inv_freq  # [B, S, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, S, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, n, S, d] by the tables [B, S, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, S, d]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass
class KVCache:
    """Keys/values of the draft layer, ``[B, n_kv, S, head_dim]`` each, RoPE applied. Immutable by convention."""

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
        """Keep the entries at ``index`` [S'] in that order (e.g. prefix + the accepted tree path)."""
        return KVCache(self.key.index_select(2, index), self.value.index_select(2, index))


def build_attention_mask(num_new: int, past: int, device: torch.device, tree_mask: torch.Tensor | None = None,
                         key_padding: torch.Tensor | None = None) -> torch.Tensor:
    """Bool mask ``[B|1, 1, S, P+S]`` (True = attend) for ``S`` new queries over ``P`` cached + ``S`` new keys.

    Without ``tree_mask``: every cached key, and the new keys causally. ``tree_mask`` ``[S, S]`` replaces the
    causal pattern among the new keys (all cached keys stay visible); ``[S, P+S]`` gives full control, e.g.
    an EAGLE-2 tree expansion whose nodes may only see their own ancestors among earlier draft entries.
    ``key_padding`` [B, P+S] (1 = real token) hides padding keys. Every query always sees itself so no row is
    empty (padding queries then produce finite garbage that the losses mask out).
    """
    if tree_mask is None:
        new = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()
        mask = torch.cat((torch.ones(num_new, past, dtype=torch.bool, device=device), new), dim=1)
    elif tuple(tree_mask.shape) == (num_new, num_new):
        mask = torch.cat((torch.ones(num_new, past, dtype=torch.bool, device=device),
                          tree_mask.to(device=device, dtype=torch.bool)), dim=1)
    elif tuple(tree_mask.shape) == (num_new, past + num_new):
        mask = tree_mask.to(device=device, dtype=torch.bool)
    else:
        raise ValueError(f"tree_mask must be [{num_new}, {num_new}] or [{num_new}, {past + num_new}] (new queries x "
                         f"new or all keys), got {tuple(tree_mask.shape)}")
    mask = mask[None, None]  # [1, 1, S, P+S]
    if key_padding is not None:
        mask = mask & key_padding.bool()[:, None, None, :]  # [B, 1, S, P+S]
    eye = torch.zeros(num_new, past + num_new, dtype=torch.bool, device=device)
    eye[:, past:] = torch.eye(num_new, dtype=torch.bool, device=device)
    return mask | eye[None, None]


class DraftAttention(nn.Module):
    """Llama GQA self-attention (no biases) whose q/k/v read ``in_features`` inputs, with a KV cache."""

    def __init__(self, config: EagleConfig, in_features: int) -> None:
        super().__init__()
        self.config = config
        c = config
        self.q_proj = nn.Linear(in_features, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None = None) -> tuple[torch.Tensor, KVCache]:
        """x [B, S, in], positions [B, S], mask [B|1, 1, S, P+S] bool -> (out [B, S, H], cache incl. the new keys)."""
        c = self.config
        bsz, seq, _ = x.shape
        q = self.q_proj(x).view(bsz, seq, c.num_attention_heads, c.head_dim).transpose(1, 2)  # [B, nh, S, d]
        k = self.k_proj(x).view(bsz, seq, c.num_key_value_heads, c.head_dim).transpose(1, 2)  # [B, nkv, S, d]
        v = self.v_proj(x).view(bsz, seq, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache = KVCache(k, v) if cache is None else cache.append(k, v)
        groups = c.num_attention_heads // c.num_key_value_heads
        keys = cache.key.repeat_interleave(groups, dim=1)  # [B, nh, P+S, d]
        values = cache.value.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, nh, S, d]
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


def default_positions(batch: int, seq: int, start: int, device: torch.device) -> torch.Tensor:
    """Positions ``start .. start+seq-1`` for every row, [B, S]."""
    return torch.arange(start, start + seq, device=device).expand(batch, seq)


# ----------------------------------------------------------------------------------------------------------
# EAGLE-1
# ----------------------------------------------------------------------------------------------------------


class EagleLayer(nn.Module):
    """Llama decoder layer without ``input_layernorm`` (EAGLE-1 removes it for its single layer)."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config, config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None) -> tuple[torch.Tensor, KVCache]:
        attn, cache = self.self_attn(x, positions, mask, cache)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), cache


def _frozen(weight: torch.Tensor, shape: tuple[int, int], what: str) -> torch.Tensor:
    if tuple(weight.shape) != shape:
        raise ValueError(f"{what} has shape {tuple(weight.shape)}, expected {shape}: pass the weight of the "
                         "target this drafter was built for")
    return weight.detach()


class EagleDrafter(nn.Module):
    """EAGLE-1 drafter. The target's embedding and LM head are frozen non-persistent buffers (never exported)."""

    def __init__(self, config: EagleConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = EagleLayer(config)
        shape = (config.vocab_size, h)
        self.register_buffer("embed_weight", _frozen(embed_weight, shape, "embed_weight"), persistent=False)
        self.register_buffer("lm_head_weight", _frozen(lm_head_weight, shape, "lm_head_weight"), persistent=False)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_kv: KVCache | None = None, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, KVCache]:
        """Predict the next features.

        input_ids [B, S]: the token AFTER each feature (``x_{t+1}``); features [B, S, H]: ``f_t`` (post-norm).
        attention_mask [B, P+S] (optional, 1 = real) covers cached and new pairs; positions [B, S] default to
        ``P .. P+S-1``; tree_mask [S, S] or [S, P+S] replaces the causal pattern (see build_attention_mask).
        Returns ``(f̂ [B, S, H], cache)`` where ``f̂[:, i]`` predicts the feature of the position after pair i.
        """
        if input_ids.shape != features.shape[:2]:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and features {tuple(features.shape)} must "
                             "share [B, S]")
        dtype = self.fc.weight.dtype
        past = 0 if past_kv is None else past_kv.length
        bsz, seq = input_ids.shape
        if positions is None:
            positions = default_positions(bsz, seq, past, input_ids.device)
        emb = F.embedding(input_ids, self.embed_weight).to(dtype)  # [B, S, H]
        z = self.fc(torch.cat((emb, features.to(dtype)), dim=-1))  # [B, S, 2H] -> [B, S, H]
        mask = build_attention_mask(seq, past, input_ids.device, tree_mask, attention_mask)
        return self.layer(z, positions, mask, past_kv)

    def logits(self, pred_features: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V] through the target's frozen LM head."""
        w = self.lm_head_weight
        return F.linear(pred_features, w if w.dtype == pred_features.dtype else w.to(pred_features.dtype))

    def architecture(self) -> dict[str, Any]:
        """Architecture block of the export config."""
        return asdict(self.config)

    @classmethod
    def from_export(cls, export_dir: str | Path, embed_weight: torch.Tensor,
                    lm_head_weight: torch.Tensor) -> EagleDrafter:
        """Rebuild from a draftsmith export; the target's embedding and LM head are passed in (not stored)."""
        config, state = read_export(export_dir)
        if config["method"] != "eagle":
            raise ExportError(f"{export_dir} holds a {config['method']!r} export, not eagle")
        drafter = cls(EagleConfig(**config["architecture"]), embed_weight, lm_head_weight)
        _load_strict(drafter, state, export_dir)
        return drafter


def _load_strict(module: nn.Module, state: dict[str, torch.Tensor], export_dir: str | Path) -> None:
    """Load exported weights, naming missing/unexpected keys (non-persistent buffers are never in exports)."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ExportError(f"{export_dir}: weights do not match the architecture (missing {missing[:4]}, "
                          f"unexpected {unexpected[:4]}); re-export the drafter")
