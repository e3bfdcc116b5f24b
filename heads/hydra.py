"""Hydra / Hydra++ heads: sequentially dependent ("grounded") Medusa heads (arXiv 2402.05109).

Head k (0-based) at position t reads the target's last hidden state ``h_t`` (post final norm) and
the embeddings of the ``k+1`` tokens before its own on the path: ``x_{t+1}`` (the target's own next
token, the tree root) and the tokens drafted by heads ``0..k-1`` (``x_{t+2} .. x_{t+k+1}``); it
predicts ``x_{t+k+2}`` (same alignment as Medusa: the target LM head predicts ``t+1``). Input width
``(k+2) * H``: ``concat(h_t, E(x_{t+1}), ..., E(x_{t+k+1}))``, E the target's frozen input
embedding.

Head layout: a grounded block ``res(z) + SiLU(W z)`` (W zero-initialised, ``res`` a learned ``(k+2)H
-> H`` projection initialised to pick ``h_t``, so a fresh head starts as a Medusa head),
``num_layers - 1`` ResBlocks, and an LM head (own copy of the target's, with bias, or the shared
frozen one). Hydra++ adds dropout before every block and the LM head, and a prefix-attention layer:
one Llama decoder layer with causal self-attention over the context's hidden states whose output
replaces ``h_t`` (its output projections start at zero, so it starts as the identity; it has no
final norm, a deviation from the paper's 1-layer ``LlamaModel``, so the heads start where Hydra's
do).

Runtime API: ``context(hidden, positions, cache)`` runs the prefix layer (identity without one) over
new context positions with a :class:`~draftsmith.common.layers.KVCache`; ``step(ctx [N, H], prefix
[N, k+1])`` gives head k's logits for a frontier of N paths at once, ``prefix[:, 0]`` the root token
and ``prefix[:, j]`` the token drafted by head ``j-1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.common.layers import (
    DecoderLayer,
    KVCache,
    build_attention_mask,
    default_positions,
)
from draftsmith.export.exportable import Exportable, ExportContents
from draftsmith.heads.medusa import ResBlock

METHODS = ("hydra", "hydra_pp")


@dataclass
class HydraConfig:
    """Architecture of a set of Hydra heads (the prefix-layer sizes follow the target's layers)."""

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1  # MLP depth: the grounded block + (num_layers - 1) ResBlocks
    dropout: float = 0.0
    share_lm_head: bool = False
    prefix_layer: bool = False
    num_attention_heads: int = 0  # prefix layer only
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError(
                f"num_heads and num_layers must be >= 1, got {self.num_heads}, {self.num_layers}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if (
            self.prefix_layer
            and min(
                self.num_attention_heads,
                self.num_key_value_heads,
                self.head_dim,
                self.intermediate_size,
            )
            < 1
        ):
            raise ValueError(
                "prefix_layer=True needs num_attention_heads, num_key_value_heads, head_dim and "
                "intermediate_size (size it from the target's HF config)"
            )


class GroundedBlock(nn.Module):
    """``res(z) + SiLU(W z)`` for ``z`` of width ``(k+2) H``; ``res`` starts as ``[I | 0]`` (picks
    ``h_t``)."""

    def __init__(self, in_features: int, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, hidden_size)
        self.res_connection = nn.Linear(in_features, hidden_size, bias=False)
        with torch.no_grad():
            nn.init.zeros_(self.linear.weight)
            self.res_connection.weight.zero_()
            self.res_connection.weight[:, :hidden_size].copy_(torch.eye(hidden_size))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.res_connection(z) + F.silu(self.linear(z))  # [..., (k+2)H] -> [..., H]


class HydraHead(nn.Module):
    """Head k: grounded block, ResBlocks, dropout before each block and before its LM head."""

    def __init__(self, config: HydraConfig, k: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.grounded = GroundedBlock((k + 2) * h, h)
        self.blocks = nn.ModuleList([ResBlock(h) for _ in range(config.num_layers - 1)])
        self.dropout = nn.Dropout(config.dropout)
        self.lm_head = None if config.share_lm_head else nn.Linear(h, config.vocab_size, bias=True)

    def forward(self, z: torch.Tensor, shared_lm_head: torch.Tensor | None) -> torch.Tensor:
        return self.logits(z, shared_lm_head)  # [..., V]

    def features(self, z: torch.Tensor) -> torch.Tensor:
        """The LM head's input: z [..., (k+2)H] -> [..., H]."""
        x = self.grounded(self.dropout(z))  # [..., H]
        for block in self.blocks:
            x = block(self.dropout(x))
        return self.dropout(x)

    def logits(self, z: torch.Tensor, shared_lm_head: torch.Tensor | None) -> torch.Tensor:
        """Inference logits [..., V] through the LM head module itself (bias added, no weight copy),
        so a packed bf16 GEMM that replaced it serves it."""
        x = self.features(z)
        return F.linear(x, shared_lm_head.to(x.dtype)) if self.lm_head is None else self.lm_head(x)

    def parts(
        self, z: torch.Tensor, shared_lm_head: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(LM-head input, LM-head weight) with ``F.linear(x, w)`` = the logits; an own head's bias
        is folded in as an extra input column of ones, so a fused linear + cross-entropy can take
        the pair (training: this copies the [V, H] weight each call, which inference avoids through
        :meth:`logits`)."""
        x = self.features(z)
        if self.lm_head is None:
            return x, shared_lm_head.to(x.dtype)
        ones = x.new_ones((*x.shape[:-1], 1))
        return torch.cat([x, ones], -1), torch.cat(
            [self.lm_head.weight, self.lm_head.bias[:, None]], 1
        )  # H+1


class PrefixLayer(DecoderLayer):
    """Hydra++'s prefix attention: a Llama decoder layer over the context's hidden states, identity
    at init."""

    def __init__(self, config: HydraConfig) -> None:
        super().__init__(config)
        nn.init.zeros_(self.self_attn.o_proj.weight)
        nn.init.zeros_(self.mlp.down_proj.weight)


class HydraHeads(Exportable, nn.Module):
    """K grounded heads; the target's embedding (and LM head when shared) are frozen non-persistent
    buffers."""

    method, also_loads = METHODS[0], METHODS[1:]
    config_class = HydraConfig

    def __init__(
        self,
        config: HydraConfig,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        shape = (config.vocab_size, config.hidden_size)
        if tuple(embed_weight.shape) != shape:
            raise ValueError(
                f"embed_weight has shape {tuple(embed_weight.shape)}, expected {shape}"
            )
        if lm_head_weight is not None and tuple(lm_head_weight.shape) != shape:
            raise ValueError(
                f"lm_head_weight has shape {tuple(lm_head_weight.shape)}, expected {shape}"
            )
        if config.share_lm_head and lm_head_weight is None:
            raise ValueError("share_lm_head=True needs the target's lm_head_weight")
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer(
            "shared_lm_head",
            lm_head_weight.detach() if config.share_lm_head else None,
            persistent=False,
        )
        self.heads = nn.ModuleList([HydraHead(config, k) for k in range(config.num_heads)])
        self.prefix = PrefixLayer(config) if config.prefix_layer else None
        if lm_head_weight is not None and not config.share_lm_head:
            with torch.no_grad():
                for head in self.heads:  # each head starts as the target's LM head (bias 0)
                    head.lm_head.weight.copy_(lm_head_weight)
                    head.lm_head.bias.zero_()

    def context(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KVCache | None]:
        """The heads' context state for new positions: hidden [B, S, H] (post-norm) -> (ctx [B, S,
        H], cache).

        Identity (and cache None) without a prefix layer. With one: causal attention over cached +
        new positions; ``attention_mask`` [B, P+S] (1 = real) hides padding; positions default to
        ``P .. P+S-1``.
        """
        if self.prefix is None:
            return hidden, None
        dtype = self.prefix.self_attn.q_proj.weight.dtype
        bsz, seq = hidden.shape[:2]
        past = 0 if cache is None else cache.length
        if positions is None:
            positions = default_positions(bsz, seq, past, hidden.device)
        mask = build_attention_mask(seq, past, hidden.device, None, attention_mask)
        return self.prefix(hidden.to(dtype), positions, mask, cache)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Frozen target embeddings of ``tokens`` [...] -> [..., H]."""
        return F.embedding(tokens, self.embed_weight)

    def head_logits(self, ctx: torch.Tensor, prefix_emb: torch.Tensor, k: int) -> torch.Tensor:
        """Head k on ctx [..., H] and the embeddings of its k+1 prefix tokens [..., k+1, H] ->
        logits [..., V]."""
        return self.heads[k].logits(self._head_input(ctx, prefix_emb, k), self.shared_lm_head)

    @staticmethod
    def _head_input(ctx: torch.Tensor, prefix_emb: torch.Tensor, k: int) -> torch.Tensor:
        """Head k's grounded input: ctx [..., H] and prefix_emb [..., k+1, H] -> [..., (k+2)H]."""
        if prefix_emb.shape[-2] != k + 1:
            raise ValueError(f"head {k} reads {k + 1} prefix tokens, got {prefix_emb.shape[-2]}")
        return torch.cat([ctx, prefix_emb.to(ctx.dtype).flatten(-2)], dim=-1)

    def head_parts(
        self, ctx: torch.Tensor, prefix_emb: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`head_logits` split at the LM head: (input [..., H or H+1], weight [V, H or
        H+1])."""
        return self.heads[k].parts(self._head_input(ctx, prefix_emb, k), self.shared_lm_head)

    def step(self, ctx: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """Runtime expansion of one tree depth: ctx [N, H], prefix tokens [N, k+1] -> head k's
        logits [N, V].

        ``prefix[:, 0]`` is the root (the target's next token), ``prefix[:, j]`` the token head
        ``j-1`` drafted.
        """
        k = prefix.shape[-1] - 1
        if not 0 <= k < self.config.num_heads:
            raise ValueError(
                f"prefix of {prefix.shape[-1]} tokens asks for head {k}; this export has "
                f"{self.config.num_heads} heads"
            )
        return self.head_logits(ctx, self.embed(prefix), k)

    def teacher_forced(
        self, ctx: torch.Tensor, input_ids: torch.Tensor, k: int, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Training: head k at every position t < T-k-2 with the real tokens ``x_{t+1..t+k+1}`` as
        its prefix.

        ctx [B, T, H], input_ids [B, T] -> logits [B, T-k-2, V] (row t predicts ``x_{t+k+2}``); with
        ``keep`` [B, T-k-2] bool, only the kept rows -> [N, V] (the V-wide LM head dominates the
        cost).
        """
        return F.linear(*self.teacher_forced_parts(ctx, input_ids, k, keep))

    def teacher_forced_parts(
        self, ctx: torch.Tensor, input_ids: torch.Tensor, k: int, keep: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`teacher_forced` split at the LM head (see :meth:`head_parts`), for a fused LM-head
        loss."""
        n = input_ids.shape[1] - k - 2
        prefix = torch.stack(
            [input_ids[:, 1 + j : 1 + j + n] for j in range(k + 1)], dim=-1
        )  # [B, n, k+1]
        rows = ctx[:, :n]  # [B, n, H]
        if keep is not None:
            rows, prefix = rows[keep], prefix[keep]  # [N, H], [N, k+1]
        return self.head_parts(rows, self.embed(prefix), k)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """What an export stores (never the frozen embedding or shared LM head)."""
        return dict(self.state_dict())

    @classmethod
    def _build(
        cls,
        architecture: HydraConfig,
        export: ExportContents,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor | None = None,
    ) -> HydraHeads:
        """Heads on the target's embedding (and LM head if shared), which the export does not
        store."""
        return cls(
            architecture, embed_weight, lm_head_weight if architecture.share_lm_head else None
        )
