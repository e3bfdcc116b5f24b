"""Kangaroo self-drafter: the target's first ``exit_layer`` layers + a one-attention-block adapter +
the target's LM head.

The shallow sub-network IS the target's: the drafter keeps references to the target's first layers
(never copies, never registers them, so they are neither trained nor exported) and the runtime runs
them on the target's own KV cache. Their output at position t is the residual stream entering layer
``exit_layer`` (HF ``hidden_states[ℓ]``, ``Target`` tap ``layers=(ℓ,)``); in training the target
forward already computes it with those very layers.

Adapter (Kangaroo ``AdapterModel``): ``x = s + Attention(RMSNorm(s))`` (one Llama attention block,
no MLP), then its own final ``RMSNorm``; the frozen target LM head turns that into the draft
distribution of token t+1, distilled from the target's distribution at the same position t (no extra
shift). Trainable: the adapter only (4h² + 2h for MHA).

The attention's output projection starts at zero and the final norm from the target's final norm
when given, so an untrained adapter is exactly the "early exit" drafter ``lm_head(norm(s))``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.common.layers import (
    DraftAttention,
    KVCache,
    RMSNorm,
    build_attention_mask,
    check_attention_shape,
    default_positions,
)
from draftsmith.export.exportable import Exportable


def default_exit_layer(num_layers: int) -> int:
    """Kangaroo exits after 2 of Vicuna-7B's 32 layers (3 of 13B's 40): about 1/16 of the depth, at
    least 1."""
    return max(1, min(num_layers - 1, int(num_layers / 16 + 0.5)))  # round half up: 40 -> 3


def check_exit_layer(exit_layer: int, num_layers: int) -> int:
    """``exit_layer`` when it lies inside the target's depth (1 .. num_layers-1), else a ValueError
    naming the range."""
    if not 1 <= int(exit_layer) <= num_layers - 1:
        raise ValueError(
            f"exit_layer {exit_layer} is outside the target's depth: "
            f"valid choices are 1..{num_layers - 1} "
            f"(the target has {num_layers} layers; default {default_exit_layer(num_layers)})"
        )
    return int(exit_layer)


@dataclass
class KangarooConfig:
    """Architecture of the adapter (attention sizes follow the target) and where it exits the
    target."""

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    exit_layer: int
    num_target_layers: int
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        check_attention_shape(self)
        check_exit_layer(self.exit_layer, self.num_target_layers)


class KangarooAdapter(nn.Module):
    """``norm(s + Attention(input_norm(s)))``: shallow states [B, S, H] -> post-norm draft features
    [B, S, H]."""

    def __init__(
        self, config: KangarooConfig, final_norm_weight: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config, config.hidden_size)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        with torch.no_grad():
            self.self_attn.o_proj.weight.zero_()  # starts as the early-exit drafter
            if final_norm_weight is not None:
                self.norm.weight.copy_(final_norm_weight.detach().float())

    def forward(
        self,
        shallow: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_kv: KVCache | None = None,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KVCache]:
        """shallow [B, S, H] (positions default to ``past .. past+S-1``) -> (features [B, S, H],
        cache)."""
        x = shallow.to(self.input_layernorm.weight.dtype)
        bsz, seq, _ = x.shape
        past = 0 if past_kv is None else past_kv.length
        if positions is None:
            positions = default_positions(bsz, seq, past, x.device)
        mask = build_attention_mask(
            seq, past, x.device, tree_mask, attention_mask
        )  # [B|1, 1, S, P+S]
        attn, cache = self.self_attn(self.input_layernorm(x), positions, mask, past_kv)
        return self.norm(x + attn), cache  # [B, S, H]


class KangarooDrafter(Exportable, nn.Module):
    """The self-drafter: shared shallow target layers (references), the adapter, the frozen target
    LM head."""

    method = "kangaroo"
    config_class = KangarooConfig
    target_weights = ("lm_head_weight",)
    # It drafts with the target's own shallow layers: the states of drafted tokens come from a
    # target forward over them (a stacked acceptance head reads those), not from the drafter's own
    # recurrence.
    self_drafting = True

    @property
    def tapped_layers(self) -> tuple[int, ...]:
        """Target layers (HF ``hidden_states`` indices) the drafter reads: the exit layer's
        input."""
        return (self.config.exit_layer,)

    def __init__(
        self,
        config: KangarooConfig,
        lm_head_weight: torch.Tensor,
        shallow_layers: Sequence[Any] = (),
        final_norm_weight: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if tuple(lm_head_weight.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"lm_head_weight has shape {tuple(lm_head_weight.shape)}, expected "
                f"{(config.vocab_size, config.hidden_size)}: pass the target's LM head"
            )
        if shallow_layers and len(shallow_layers) != config.exit_layer:
            raise ValueError(
                f"got {len(shallow_layers)} shallow layers for exit_layer {config.exit_layer}"
            )
        self.config = config
        self.adapter = KangarooAdapter(config, final_norm_weight)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)
        # A plain tuple: the target's own layer objects, not submodules (never trained, saved or
        # moved by us).
        self._shallow: tuple[Any, ...] = tuple(shallow_layers)

    @property
    def shallow_layers(self) -> tuple[Any, ...]:
        """The target's first ``exit_layer`` decoder layers (the same objects, the same storage)."""
        return self._shallow

    def forward(
        self,
        shallow: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_kv: KVCache | None = None,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KVCache]:
        """The adapter on the shallow states (see :class:`KangarooAdapter`)."""
        return self.adapter(shallow, attention_mask, past_kv, positions, tree_mask)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V] through the target's frozen LM head."""
        w = self.lm_head_weight
        return F.linear(features, w if w.dtype == features.dtype else w.to(features.dtype))

    def logit_parts(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(LM-head input, frozen LM-head weight), for a fused linear + cross-entropy."""
        return features, self.lm_head_weight
