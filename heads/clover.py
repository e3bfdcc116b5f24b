"""Clover-2 heads (arXiv 2408.00264): a token-attention block, an augmenting block and recurrent
draft heads.

Inputs follow EAGLE's pairing: pair ``t`` is ``(p_t, x_{t+1})`` with ``p_t`` the target's
PRE-final-norm last hidden state (``Target`` tap ``prenorm_hidden``) and ``x_{t+1}`` the token after
it. RoPE position of pair ``t`` is ``t``.

1. Token attention (the "attention decoder", with its gate): ``s = p + gate * v(e)``, ``e`` =
   embedding of ``x_{t+1}``, ``gate`` one scalar per attention head, the cosine similarity of
   ``q(RMSNorm(p))`` and ``k(e)``.
2. Augmenting block: ``num_layers`` Llama decoder layers (causal self-attention over the context, a
   KV cache per layer at inference) initialised from the target's LAST decoder layer, then a norm
   initialised from the target's final norm: ``c_t``.
3. Heads (the regressive connection): head 0 outputs ``o_0 = norm_h(W_0 c_t)``; head ``i >= 1``
   updates a state ``s_i = TA_2(s_{i-1}, e(x_{t+i+1}))`` (``s_0 = c_t``, one shared token-attention
   block) and outputs ``o_i = norm_h(W_2 [s_i ; e(x_{t+i+1})])``. ``o_i`` regresses the target's
   post-norm feature ``f_{t+i+1}`` and the target's frozen LM head turns it into the distribution of
   ``x_{t+i+2}``.

Runtime API: ``context(prenorm, next_tokens, ...)`` -> (c, caches); ``first(c [N, H])`` -> (state,
logits of ``x_{t+2}``); ``step(state [N, H], token [N])`` -> (state', logits of the token after
``token``), batched over a tree frontier. Training runs every head at every position at once
(``teacher_forced``), which equals running ``first`` then ``step`` position by position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.common.layers import (
    DecoderLayer,
    KVCache,
    RMSNorm,
    build_attention_mask,
    default_positions,
)
from draftsmith.export.exportable import Exportable

EMBED_SOURCES = ("embed", "lm_head")


@dataclass
class CloverConfig:
    """Architecture of Clover-2 heads (layer sizes follow the target's HF config)."""

    hidden_size: int
    vocab_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_heads: int = 5  # draft heads (tree depth)
    num_layers: int = 2  # augmenting decoder layers
    # token embedding: the target's input embedding, or its LM head (the paper)
    embed_source: str = "embed"

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError(
                f"num_heads and num_layers must be >= 1, got {self.num_heads}, {self.num_layers}"
            )
        if self.embed_source not in EMBED_SOURCES:
            raise ValueError(
                f"embed_source={self.embed_source!r}; valid: {', '.join(EMBED_SOURCES)}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                "hidden_size must be a multiple of num_attention_heads (token-attention gates)"
            )


def _near_identity(linear: nn.Linear, scale: float = 0.01) -> None:
    """Weight ``[I | U(0, scale)]`` (identity on the first ``out`` inputs), bias 0: the paper's
    initialisation."""
    with torch.no_grad():
        linear.weight.uniform_(0.0, scale)
        linear.weight[:, : linear.out_features] += torch.eye(linear.out_features)
        if linear.bias is not None:
            linear.bias.zero_()


class TokenAttention(nn.Module):
    """``state + v(e) * gate``, per-head gate = cosine(q(RMSNorm(state)), k(e))."""

    def __init__(self, hidden_size: int, num_gates: int, eps: float) -> None:
        super().__init__()
        self.num_gates = num_gates
        self.norm = RMSNorm(hidden_size, eps)
        self.q = nn.Linear(hidden_size, hidden_size)
        self.k = nn.Linear(hidden_size, hidden_size)
        self.v = nn.Linear(hidden_size, hidden_size)
        _near_identity(self.q)
        _near_identity(self.k)
        with torch.no_grad():
            self.v.weight.uniform_(0.0, 0.01)
            self.v.bias.zero_()

    def forward(self, state: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        split = (*state.shape[:-1], self.num_gates, -1)
        q = self.q(self.norm(state)).view(split)  # [..., n, d]
        k = self.k(emb).view(split)
        gate = F.cosine_similarity(q, k, dim=-1).unsqueeze(-1)  # [..., n, 1]
        return state + (self.v(emb).view(split) * gate).flatten(-2)  # [..., H]


class CloverHeads(Exportable, nn.Module):
    """Clover-2 (see the module docstring). The token embedding and LM head are frozen
    non-persistent buffers."""

    method = "clover2"
    config_class = CloverConfig

    def __init__(
        self,
        config: CloverConfig,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        init_layer: dict[str, torch.Tensor] | None = None,
        final_norm: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        h, shape = config.hidden_size, (config.vocab_size, config.hidden_size)
        for name, w in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
            if tuple(w.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {shape}")
            self.register_buffer(name, w.detach(), persistent=False)
        # set by the runtime (see logits)
        self.lm_head_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.token_attn = TokenAttention(h, config.num_attention_heads, config.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.num_layers)])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.head_mlp = nn.Linear(h, h)
        self.rnn = TokenAttention(h, config.num_attention_heads, config.rms_norm_eps)
        self.head_mlp2 = nn.Linear(2 * h, h)
        self.head_norm = RMSNorm(h, config.rms_norm_eps)
        _near_identity(self.head_mlp)
        _near_identity(self.head_mlp2)
        if init_layer is not None:
            for layer in self.layers:
                missing, unexpected = layer.load_state_dict(init_layer, strict=False)
                if missing or unexpected:
                    raise ValueError(
                        "the target's last layer does not fit a Llama decoder layer (missing "
                        f"{missing[:3]}, unexpected {unexpected[:3]}): "
                        "Clover-2 needs a Llama-family target"
                    )
        if final_norm is not None:
            with torch.no_grad():
                self.norm.weight.copy_(final_norm)
                self.head_norm.weight.copy_(final_norm)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Frozen token embeddings [...] -> [..., H] in the heads' dtype."""
        return F.embedding(tokens, self.embed_weight).to(self.head_mlp.weight.dtype)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V] of a head output through the target's frozen LM head
        (``lm_head_fn`` when the runtime sets one: the target's own head on its fast linears, same
        weights)."""
        if self.lm_head_fn is not None:
            return self.lm_head_fn(out)
        return F.linear(out, self.lm_head_weight.to(out.dtype))

    def context(
        self,
        prenorm: torch.Tensor,
        next_tokens: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        caches: list[KVCache] | None = None,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[KVCache]]:
        """Pairs ``(p_t, x_{t+1})``: prenorm [B, S, H], next_tokens [B, S] -> (c [B, S, H], one
        cache per layer).

        ``attention_mask`` [B, P+S] (1 = real pair) covers cached and new pairs; positions default
        to ``P..P+S-1``.
        """
        bsz, seq = next_tokens.shape
        past = 0 if caches is None else caches[0].length
        if positions is None:
            positions = default_positions(bsz, seq, past, next_tokens.device)
        mask = build_attention_mask(seq, past, next_tokens.device, None, attention_mask)
        x = self.token_attn(
            prenorm.to(self.head_mlp.weight.dtype), self.embed(next_tokens)
        )  # [B, S, H]
        new_caches = []
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, positions, mask, None if caches is None else caches[i])
            new_caches.append(cache)
        return self.norm(x), new_caches

    def first(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Head 0: c [N, H] -> (state s_0 = c, output o_0 [N, H], logits of x_{t+2} [N, V])."""
        out = self.head_norm(self.head_mlp(c))
        return c, out, self.logits(out)

    def step(
        self, state: torch.Tensor, token: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One regressive step: state [N, H] and the token just drafted [N] -> (state', output [N,
        H], logits [N, V] of the token after it)."""
        emb = self.embed(token)  # [N, H]
        state = self.rnn(state, emb)
        out = self.head_norm(self.head_mlp2(torch.cat([state, emb], dim=-1)))  # [N, 2H] -> [N, H]
        return state, out, self.logits(out)

    def teacher_forced(self, c: torch.Tensor, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """Every head's output at every position at once: c [B, n, H] (pairs t = 0..n-1), input_ids
        [B, T] -> ``[o_0 [B, T-2, H], o_1 [B, T-3, H], ...]`` (row t of ``o_i`` predicts
        ``x_{t+i+2}``)."""
        total = input_ids.shape[1]
        outs = [self.head_norm(self.head_mlp(c[:, : total - 2]))]
        state = c
        for i in range(1, self.config.num_heads):
            n = total - 2 - i
            if n < 1:
                break
            emb = self.embed(
                input_ids[:, i + 1 : i + 1 + n]
            )  # x_{t+i+1}, the token head i-1 drafted
            state = self.rnn(state[:, :n], emb)
            outs.append(self.head_norm(self.head_mlp2(torch.cat([state, emb], dim=-1))))
        return outs
