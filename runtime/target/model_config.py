"""Which Llama-family checkpoints the lean decoder runs: the HF ``config.json`` fields it needs and RoPE frequencies."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsmith.runtime.target.weights import load_hf_config

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # SmolLM checkpoints say "llama"
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedArchitecture(NotImplementedError):
    """The checkpoint is not one the lean decoder implements; load it with the HF fallback (backend='hf')."""


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
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # rope_type + its parameters; {} = default
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool = False  # Llama/Qwen3 when attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm per head on q and k before RoPE
    sliding_window: int | None = None  # active window (None = full attention)
    max_position_embeddings: int = 2048

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", "default")

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF ``config.json``; raises UnsupportedArchitecture for what the lean decoder lacks."""
        model_type = cfg.get("model_type", "<missing>")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitecture(
                f"model_type {model_type!r} is not supported by the lean decoder (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}); use the transformers fallback (backend='hf')"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitecture(f"hidden_act {act!r} is not supported (only silu); use backend='hf'")
        # transformers v5 writes "rope_parameters" (theta inside); v4 wrote "rope_theta" + "rope_scaling".
        rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedArchitecture(
                f"rope type {rope_type!r} is not implemented in the lean decoder (supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}); use backend='hf'"
            )
        if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
            raise UnsupportedArchitecture("partial rotary embeddings are not supported; use backend='hf'")
        rope = {**rope, "rope_type": rope_type} if rope_type != "default" else {}
        heads = int(cfg["num_attention_heads"])
        bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            window = None  # Qwen configs carry a window size that is inactive unless use_sliding_window
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
            rope_theta=theta,
            rope_scaling=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else bias,
            o_bias=False if model_type == "qwen2" else bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=int(window) if window else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        """Read ``folder/config.json``."""
        return cls.from_hf_dict(load_hf_config(folder))


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [d/2] (fp32) for the config's RoPE type (default, linear, llama3)."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # [d/2]
    params = config.rope_scaling
    if config.rope_type == "linear":
        inv = inv / float(params["factor"])
    elif config.rope_type == "llama3":
        # Llama 3.1: divide low frequencies by `factor`, keep high ones, interpolate smoothly in between.
        factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv = torch.where(medium, smoothed, scaled)
    return inv
