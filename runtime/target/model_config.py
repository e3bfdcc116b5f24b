"""Which checkpoints the lean decoder runs: the HF ``config.json`` fields it needs, RoPE frequencies
and tables, and :func:`lean_support` (what the loader asks before choosing the lean decoder or the
transformers fallback).

The per-family reading (windows per layer, RoPE layouts, Gemma features) lives in
:mod:`draftsmith.runtime.target.families`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsmith.runtime.target.families import (
    GEMMA_TYPES,
    SUPPORTED_MODEL_TYPES,
    SUPPORTED_ROPE_TYPES,
    UnsupportedArchitecture,
    activation,
    check_model_type,
    gemma_fields,
    layer_windows,
    rope_fields,
)
from draftsmith.runtime.target.weights import load_hf_config

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "ModelConfig",
    "UnsupportedArchitecture",
    "lean_support",
    "rope_inv_freq",
    "rope_tables",
]


@dataclass
class ModelConfig:
    """The fields of a HF ``config.json`` that the lean decoder needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(
        default_factory=dict
    )  # rope_type + its parameters; {} = default
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama/Qwen3/Gemma when attention_bias
    o_bias: bool = False  # Llama/Qwen3/Gemma when attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3, Gemma-3: RMSNorm per head on q and k before RoPE
    # the configured window (None = none); layer_windows says where it applies
    sliding_window: int | None = None
    max_position_embeddings: int = 2048
    layer_windows: tuple[
        int | None, ...
    ] = ()  # per layer: keys k visible from query q iff q - k < window; None = all
    hidden_act: str = "silu"  # the MLP gate's activation: silu or gelu_pytorch_tanh (Gemma)
    fused_checkpoint: bool = False  # Phi-3: the checkpoint stores qkv_proj and gate_up_proj fused
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + w), in fp32
    sandwich_norms: bool = False  # Gemma-2/3: post-attention, pre- and post-feedforward norms
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden)
    attn_scale: float | None = None  # Gemma: query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5)
    attn_softcap: float | None = None  # Gemma-2: scores -> cap * tanh(scores / cap) before the mask
    final_softcap: float | None = None  # Gemma-2: the same on the logits
    # Gemma-3: the sliding layers' RoPE base (None: the global one)
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layer_windows:
            self.layer_windows = (None,) * self.num_layers

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", "default")

    @property
    def llama_layer_gap(self) -> str | None:
        """The first feature of this model that the plain Llama layer (and the fused C++ layer)
        lacks; None when the plain layer serves it. The lean decoder picks its general layer by
        this, once, at load.
        """
        gaps = (
            (any(w is not None for w in self.layer_windows), "sliding-window attention"),
            (self.norm_plus_one or self.sandwich_norms, "Gemma norms"),
            (self.hidden_act != "silu", f"the {self.hidden_act} MLP"),
            (self.embed_scale is not None, "scaled embeddings"),
            (self.attn_scale is not None, "query_pre_attn_scalar"),
            (self.attn_softcap is not None or self.final_softcap is not None, "logit softcapping"),
            (self.local_rope_theta is not None, "a local RoPE base"),
        )
        return next((name for gap, name in gaps if gap), None)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF ``config.json``; raises UnsupportedArchitecture for what the lean
        decoder lacks."""
        model_type = check_model_type(cfg)
        heads = int(cfg["num_attention_heads"])
        bias = bool(cfg.get("attention_bias", False))
        windows, window = layer_windows(cfg, model_type)
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type in GEMMA_TYPES)),
            qkv_bias=True if model_type == "qwen2" else bias,
            o_bias=False if model_type == "qwen2" else bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            sliding_window=window,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            layer_windows=windows,
            hidden_act=activation(cfg, model_type),
            fused_checkpoint=model_type == "phi3",
            **rope_fields(cfg, model_type),
            **gemma_fields(cfg, model_type),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        """Read ``folder/config.json``."""
        return cls.from_hf_dict(load_hf_config(folder))


def lean_support(hf_config: dict[str, Any]) -> str | None:
    """None when the lean decoder serves the model of this parsed ``config.json``; else what it
    lacks, in a few
    words (e.g. "model_type 'gpt2'", "rope type 'yarn'"): such a model goes to the transformers
    fallback.
    """
    try:
        ModelConfig.from_hf_dict(hf_config)
    except UnsupportedArchitecture as err:
        return err.feature
    except (KeyError, TypeError, ValueError) as err:
        return f"an incomplete config.json ({type(err).__name__}: {err})"
    return None


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [d/2] (fp32) for the config's RoPE type (default, linear, llama3);
    ``local``: those of the sliding layers where they have their own base (Gemma-3)."""
    d = config.head_dim
    theta, params = config.rope_theta, config.rope_scaling
    if local and config.local_rope_theta is not None:
        theta, params = config.local_rope_theta, config.local_rope_scaling
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # [d/2]
    rope_type = params.get("rope_type", "default")
    if rope_type == "linear":
        inv = inv / float(params["factor"])
    elif rope_type == "llama3":
        # Llama 3.1: divide low frequencies by `factor`, keep high ones, interpolate smoothly in
        # between.
        factor, low, high = (
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
        )
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rope_tables(
    inv_freq: torch.Tensor, n: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """cos and signed-sin tables [n, 1, d] for positions 0..n-1 (fp32 math, stored in ``dtype``):
    ``rotate_half(x) * sin == roll(x, d/2) * cat(-sin, sin)``, so the sign is folded into the sin
    table.
    """
    with torch.inference_mode(
        False
    ):  # ordinary tensors even when first needed under inference_mode
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)  # [n, d/2]
        cos, sin = freqs.cos(), freqs.sin()
        return (
            torch.cat([cos, cos], -1)[:, None].to(dtype).to(device),
            torch.cat([-sin, sin], -1)[:, None].to(dtype).to(device),
        )
