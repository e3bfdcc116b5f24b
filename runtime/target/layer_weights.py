"""The lean decoder's weights at load time: HF-named checkpoint tensors gathered into per-layer buffers, with q/k/v
fused into one matrix and gate/up into another (see :class:`draftsmith.runtime.target.model.LeanDecoder`)."""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.runtime.target.model_config import ModelConfig
from draftsmith.runtime.target.weights import WeightsError

__all__ = ["FusedLayerWeights", "checkpoint_prefix", "checkpoint_tensor", "fused_layers"]


class FusedLayerWeights(nn.Module):
    """One decoder layer's (fused) weights as buffers; the math lives in LeanDecoder for speed."""

    def __init__(self, w: dict[str, torch.Tensor | None]) -> None:
        super().__init__()
        for name, tensor in w.items():
            self.register_buffer(name, tensor)


def checkpoint_prefix(weights: dict[str, torch.Tensor]) -> str:
    """``"model."`` when the checkpoint names its decoder tensors ``model.layers...`` (the prefix is optional)."""
    return "model." if "model.embed_tokens.weight" in weights else ""


def checkpoint_tensor(weights: dict[str, torch.Tensor], name: str, config: ModelConfig) -> torch.Tensor:
    """The tensor ``name`` of the checkpoint; raises WeightsError naming it when it is missing."""
    if name not in weights:
        raise WeightsError(f"tensor {name!r} is missing from the checkpoint ({config.model_type} layout expected)")
    return weights[name]


def fused_layers(config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str) -> nn.ModuleList:
    """Every decoder layer's weights (``{prefix}layers.{i}...``) as :class:`FusedLayerWeights`, q/k/v and gate/up
    concatenated; optional biases and q/k norms are None where the config has none."""

    def get(name: str) -> torch.Tensor:
        return checkpoint_tensor(weights, name, config)

    def cat(*names: str) -> torch.Tensor:
        return torch.cat([get(n) for n in names])

    p, layers = prefix, []
    for i in range(config.num_layers):
        a, m = f"{p}layers.{i}.self_attn.", f"{p}layers.{i}.mlp."
        layers.append(
            FusedLayerWeights(
                {
                    "ln1": get(f"{p}layers.{i}.input_layernorm.weight"),
                    "wqkv": cat(*(a + f"{n}_proj.weight" for n in "qkv")),  # [(Hq+2Hkv)d, H]
                    "bqkv": cat(*(a + f"{n}_proj.bias" for n in "qkv")) if config.qkv_bias else None,
                    "qn": get(a + "q_norm.weight") if config.qk_norm else None,
                    "kn": get(a + "k_norm.weight") if config.qk_norm else None,
                    "wo": get(a + "o_proj.weight"),  # [H, Hq*d]
                    "bo": get(a + "o_proj.bias") if config.o_bias else None,
                    "ln2": get(f"{p}layers.{i}.post_attention_layernorm.weight"),
                    "wgu": cat(m + "gate_proj.weight", m + "up_proj.weight"),  # [2I, H]
                    "bgu": cat(m + "gate_proj.bias", m + "up_proj.bias") if config.mlp_bias else None,
                    "wdown": get(m + "down_proj.weight"),  # [H, I]
                    "bdown": get(m + "down_proj.bias") if config.mlp_bias else None,
                }
            )
        )
    return nn.ModuleList(layers)
