"""EAGLE-1 drafter: one Llama-style decoder layer that extrapolates the target's post-norm feature.

Token/feature alignment of the EAGLE family (the one authoritative statement; recipes/eagle/,
recipes/eagle3/, drafters/eagle3.py and runtime/drafting/eagle.py refer here). The target feature
``f_t`` at input position ``t`` is the state after reading ``x_0..x_t`` (distill/target/frozen.py's
tap convention), from which the target predicts ``x_{t+1}``. The drafter's pair ``t`` is ``(f_t,
x_{t+1})``: the feature together with the token the target produced from it, which is one place
further on (the "off-by-one" shift); it sits at RoPE position ``t`` and predicts the following
feature ``f̂_{t+1}`` and so the token ``x_{t+2}``. A sequence of ``T`` tokens has pairs ``t =
0..T-2`` (``x_T`` does not exist), and a loss on pair ``t`` is masked by ``loss_mask[t+2]``, the
token it predicts.

EAGLE-1: ``z_t = fc(concat(embed(x_{t+1}), f_t))`` (embedding first, ``f_t`` the post-final-norm
``Target`` tap ``final_hidden``), then one decoder layer without ``input_layernorm`` gives
``f̂_{t+1}`` (no final norm); the target's frozen LM head turns it into the distribution of
``x_{t+2}``.

The building blocks (RMSNorm, RoPE, attention with a KV cache, SwiGLU MLP) live in
``draftsmith.common.layers`` so that heads (Hydra++, Clover-2) can use them too; they are
re-exported here.

KV cache API (used by the runtime for incremental drafting)
----------------------------------------------------------- ``KVCache(key, value)`` holds the draft
layer's keys/values ``[B, n_kv, S, head_dim]`` (RoPE already applied). ``forward(...,
past_kv=cache)`` appends the new pairs after the cache and returns the extended cache; it never
mutates its input, so the runtime can keep the cache of the accepted prefix and throw speculative
entries away with ``cache.crop(n)`` (or keep an accepted tree path with ``cache.select(index)``).
Default positions continue from ``cache.length``; pass ``positions`` explicitly for tree drafting
(siblings share a position) together with ``tree_mask``: ``[S, S]`` bool (True = new query may see
new key; all cached keys visible) or ``[S, P+S]`` (also choose which cached keys each query sees,
for EAGLE-2 tree expansion where the cache holds earlier draft nodes of other branches).

Runtime loop (greedy chain or EAGLE-2 tree): after the target has scored ``x_0..x_n`` (features
``f_0..f_n``) and produced ``x_{n+1}``, prefill the drafter with pairs ``(f_t, x_{t+1})`` for ``t =
0..n`` at positions ``0..n``; ``logits(pred[:, -1])`` drafts ``x_{n+2}``. A further draft step feeds
``(f̂, x̂)``: the drafter's own predicted feature with the token drafted from it, at the next
position. The target then scores ``x_{n+1}`` and the drafts (features ``f_{n+1}, ...``); when it
accepts ``a`` drafts and adds a bonus token ``b``, crop the drafter cache back to the ``n+1`` pairs
built from target features and append the pairs ``(f_{n+1}, x_{n+2}), ..., (f_{n+1+a}, b)`` at
positions ``n+1 .. n+1+a`` (target features of the tokens just scored, each paired with the token
that follows it); the last output drafts the next round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# re-exported: the EAGLE drafters' building blocks
from draftsmith.common.layers import (  # noqa: F401
    DraftAttention,
    KVCache,
    RMSNorm,
    SwiGLU,
    apply_rope,
    build_attention_mask,
    check_attention_shape,
    default_positions,
    rope_cos_sin,
)
from draftsmith.export.exportable import Exportable


def _rope_theta(hf_config: Any) -> float:
    """RoPE base of a HF config (transformers 5 keeps it in ``rope_parameters``, older ones in
    ``rope_theta``)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(hf_config, "rope_theta", 10000.0))


MLP_WIDTH_KEYS = (
    "intermediate_size",
    "n_inner",
    "ffn_dim",
    "ffn_hidden_size",
)  # Llama, GPT-2, OPT, Falcon


def mlp_width(hf_config: Any) -> int:
    """A HF config's MLP width under whichever name it uses (:data:`MLP_WIDTH_KEYS`); 4 x hidden
    where it names none or leaves it None (GPT-2's ``n_inner=None`` means exactly that)."""
    for key in MLP_WIDTH_KEYS:
        value = getattr(hf_config, key, None)
        if value:
            return int(value)
    return 4 * int(hf_config.hidden_size)


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
        check_attention_shape(self)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def dims_from_hf(cls, hf_config: Any) -> dict[str, Any]:
        """The size fields shared by the EAGLE family (EAGLE-1/3, and the DFlash, Clover-2, Kangaroo
        and Hydra++ layers sized like them), read from any HF causal-LM config: Llama-style names,
        or GPT-2's ``n_inner`` (None: 4 x hidden), OPT's ``ffn_dim``, Falcon's ``ffn_hidden_size``
        and the 4 x hidden convention for the MLP width (:func:`mlp_width`); a LayerNorm epsilon
        where there is no RMSNorm one."""
        heads = int(hf_config.num_attention_heads)
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or getattr(
            hf_config, "num_kv_heads", None
        )
        eps = next(
            (
                getattr(hf_config, k)
                for k in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")
                if getattr(hf_config, k, None) is not None
            ),
            1e-6,
        )
        return {
            "hidden_size": int(hf_config.hidden_size),
            "vocab_size": int(hf_config.vocab_size),
            "intermediate_size": mlp_width(hf_config),
            "num_attention_heads": heads,
            "num_key_value_heads": int(kv_heads or heads),
            "head_dim": int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads),
            "rms_norm_eps": float(eps),
            "rope_theta": _rope_theta(hf_config),
            "max_position_embeddings": int(
                getattr(hf_config, "max_position_embeddings", None) or 2048
            ),
        }

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> EagleConfig:
        """Size the drafter like one layer of the target."""
        return cls(**cls.dims_from_hf(hf_config))


# --------------------------------------------------------------------------------------------------
# Building blocks (shared with drafters/eagle3.py)
# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# EAGLE-1
# --------------------------------------------------------------------------------------------------


class EagleLayer(nn.Module):
    """Llama decoder layer without ``input_layernorm`` (EAGLE-1 removes it for its single layer)."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config, config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: KVCache | None
    ) -> tuple[torch.Tensor, KVCache]:
        attn, cache = self.self_attn(x, positions, mask, cache)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), cache


def _frozen(weight: torch.Tensor, shape: tuple[int, int], what: str) -> torch.Tensor:
    if tuple(weight.shape) != shape:
        raise ValueError(
            f"{what} has shape {tuple(weight.shape)}, expected {shape}: pass the weight of the "
            "target this drafter was built for"
        )
    return weight.detach()


class EagleDrafter(Exportable, nn.Module):
    """EAGLE-1 drafter. The target's embedding and LM head are frozen non-persistent buffers (never
    exported)."""

    method = "eagle"
    config_class = EagleConfig
    target_weights = ("embed_weight", "lm_head_weight")
    # drafts from its own recurrence over target features (see KangarooDrafter)
    self_drafting = False
    tapped_layers: tuple[
        int, ...
    ] = ()  # reads the target's post-norm final hidden state, no layer taps

    def __init__(
        self, config: EagleConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor
    ) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = EagleLayer(config)
        shape = (config.vocab_size, h)
        self.register_buffer(
            "embed_weight", _frozen(embed_weight, shape, "embed_weight"), persistent=False
        )
        self.register_buffer(
            "lm_head_weight", _frozen(lm_head_weight, shape, "lm_head_weight"), persistent=False
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_kv: KVCache | None = None,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KVCache]:
        """Predict the next features.

        input_ids [B, S]: the token AFTER each feature (``x_{t+1}``); features [B, S, H]: ``f_t``
        (post-norm). attention_mask [B, P+S] (optional, 1 = real) covers cached and new pairs;
        positions [B, S] default to ``P .. P+S-1``; tree_mask [S, S] or [S, P+S] replaces the causal
        pattern (see build_attention_mask). Returns ``(f̂ [B, S, H], cache)`` where ``f̂[:, i]``
        predicts the feature of the position after pair i.
        """
        if input_ids.shape != features.shape[:2]:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and features {tuple(features.shape)} must "
                "share [B, S]"
            )
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
        return F.linear(
            pred_features, w if w.dtype == pred_features.dtype else w.to(pred_features.dtype)
        )

    def logit_parts(self, pred_features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(LM-head input [..., H], frozen LM-head weight [V, H]): ``logits`` without the matmul,
        for a fused linear + cross-entropy that never materialises the [..., V] logits."""
        return pred_features, self.lm_head_weight
