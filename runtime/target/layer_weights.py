"""The lean decoder's weights at load time: HF-named checkpoint tensors gathered into per-layer
buffers, with q/k/v fused into one matrix and gate/up into another (see
:class:`draftsmith.runtime.target.model.LeanDecoder`).

:func:`canonical_weights` first brings other families to the Llama names: Phi-3's fused ``qkv_proj``
/ ``gate_up_proj`` are split, Gemma's RMSNorm weights become ``1 + w`` in fp32 (what its norm
multiplies by).
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.runtime.target.model_config import ModelConfig
from draftsmith.runtime.target.weights import WeightsError

__all__ = [
    "FusedLayerWeights",
    "canonical_weights",
    "checkpoint_prefix",
    "checkpoint_tensor",
    "fused_layers",
]


class FusedLayerWeights(nn.Module):
    """One decoder layer's (fused) weights as buffers; the math lives in LeanDecoder for speed."""

    def __init__(self, w: dict[str, torch.Tensor | None]) -> None:
        super().__init__()
        for name, tensor in w.items():
            self.register_buffer(name, tensor)


def canonical_weights(
    config: ModelConfig, weights: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The checkpoint under Llama names: Phi-3's ``qkv_proj`` split into q/k/v_proj and
    ``gate_up_proj`` into gate/up_proj (views: the fused buffers are rebuilt once by
    :func:`fused_layers`); Gemma's ``*norm.weight`` replaced by ``1 + w`` in fp32 (exact for bf16
    checkpoints, as transformers computes it). Other families: the same dict, untouched."""
    if not (config.fused_checkpoint or config.norm_plus_one):
        return weights
    out = dict(weights)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for name in list(out):
        if config.fused_checkpoint and name.endswith("self_attn.qkv_proj.weight"):
            stem = name.removesuffix("qkv_proj.weight")
            for part, w in zip("qkv", out.pop(name).split([q, kv, kv])):
                out[f"{stem}{part}_proj.weight"] = w
        elif config.fused_checkpoint and name.endswith("mlp.gate_up_proj.weight"):
            stem = name.removesuffix("gate_up_proj.weight")
            out[stem + "gate_proj.weight"], out[stem + "up_proj.weight"] = out.pop(name).chunk(2)
        elif config.norm_plus_one and name.endswith("norm.weight"):
            out[name] = out[name].float() + 1.0
    return out


def checkpoint_prefix(weights: dict[str, torch.Tensor]) -> str:
    """``"model."`` when the checkpoint names its decoder tensors ``model.layers...`` (the prefix is
    optional)."""
    return "model." if "model.embed_tokens.weight" in weights else ""


def checkpoint_tensor(
    weights: dict[str, torch.Tensor], name: str, config: ModelConfig
) -> torch.Tensor:
    """The tensor ``name`` of the checkpoint; raises WeightsError naming it when it is missing."""
    if name not in weights:
        raise WeightsError(
            f"tensor {name!r} is missing from the checkpoint ({config.model_type} layout expected)"
        )
    return weights[name]


def fused_layers(
    config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str
) -> nn.ModuleList:
    """Every decoder layer's weights (``{prefix}layers.{i}...``) as :class:`FusedLayerWeights`,
    q/k/v and gate/up concatenated; optional biases, q/k norms and Gemma's extra norms are None
    where the config has none. With sandwich norms (Gemma) ``ln2`` is the pre-feedforward norm and
    ``post_attn`` / ``post_ff`` normalise the attention and MLP outputs; otherwise ``ln2`` is
    Llama's post_attention_layernorm."""

    def get(name: str) -> torch.Tensor:
        return checkpoint_tensor(weights, name, config)

    def cat(*names: str) -> torch.Tensor:
        return torch.cat([get(n) for n in names])

    p, layers, sandwich = prefix, [], config.sandwich_norms
    for i in range(config.num_layers):
        a, m, n = f"{p}layers.{i}.self_attn.", f"{p}layers.{i}.mlp.", f"{p}layers.{i}."
        layers.append(
            FusedLayerWeights(
                {
                    "ln1": get(n + "input_layernorm.weight"),
                    "wqkv": cat(*(a + f"{n}_proj.weight" for n in "qkv")),  # [(Hq+2Hkv)d, H]
                    "bqkv": (
                        cat(*(a + f"{n}_proj.bias" for n in "qkv")) if config.qkv_bias else None
                    ),
                    "qn": get(a + "q_norm.weight") if config.qk_norm else None,
                    "kn": get(a + "k_norm.weight") if config.qk_norm else None,
                    "wo": get(a + "o_proj.weight"),  # [H, Hq*d]
                    "bo": get(a + "o_proj.bias") if config.o_bias else None,
                    "ln2": get(
                        n
                        + ("pre_feedforward" if sandwich else "post_attention")
                        + "_layernorm.weight"
                    ),
                    "post_attn": get(n + "post_attention_layernorm.weight") if sandwich else None,
                    "post_ff": get(n + "post_feedforward_layernorm.weight") if sandwich else None,
                    "wgu": cat(m + "gate_proj.weight", m + "up_proj.weight"),  # [2I, H]
                    "bgu": (
                        cat(m + "gate_proj.bias", m + "up_proj.bias") if config.mlp_bias else None
                    ),
                    "wdown": get(m + "down_proj.weight"),  # [H, I]
                    "bdown": get(m + "down_proj.bias") if config.mlp_bias else None,
                }
            )
        )
    return nn.ModuleList(layers)
