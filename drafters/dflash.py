"""DFlash drafter (z-lab DFlash design): a few non-causal decoder layers that draft a whole block in
one forward.

Conditioning. The target's residual stream at ``target_layers`` (our tap convention, the same as
EAGLE-3's
``target_layers``: an index into HF's ``hidden_states`` tuple, 0 = the embedding output, ``i`` = the
input of decoder layer ``i``; z-lab's ``target_layer_ids`` name layer OUTPUTS, so theirs = ours - 1)
is concatenated per position and
projected: ``ctx = hidden_norm(fc(concat(taps)))`` with ``fc.weight`` [H, n_taps * H_target]. These
context features are injected as extra keys/values of EVERY draft layer (each layer's own
``k_proj``/``v_proj`` + ``k_norm``, no ``input_layernorm``), exactly as z-lab's
``Qwen3DFlashAttention`` concatenates ``k_ctx`` before the block's keys.

Block. ``embed([x_a, mask, ..., mask])`` (``block_size`` tokens, the TARGET's embedding, shared,
never saved) at RoPE positions ``a .. a+block_size-1``; the context features sit at their own
positions ``0 .. a-1``. Attention inside the block is non-causal (every block slot sees every slot)
and every slot sees every context position ``< a``. After the layers, ``norm`` and the TARGET's LM
head (shared, never saved) give logits at block slots ``1 .. block_size-1``: slot ``k`` predicts the
token AT position ``a+k`` (not the one after it; z-lab's ``draft_logits = lm_head(out[:,
-block_size+1:])``).

Alignment with serving: ``x_a`` is the verified (root/bonus) token whose target hidden state is not
known yet, so a block anchored at ``a`` sees the target's taps of positions ``0 .. a-1`` only: at
serve time that is the prompt plus every accepted token, which is exactly what the speculative loop
hands the proposer (runtime/drafting/dflash.py).

Options (drafters/dflash_heads.py): ``confidence_head`` (DSpark-style, per-slot acceptance
probability) and ``markov_head`` (a low-rank term from the previous slot's token added to the
LM-head input). Layers are Qwen3-style: per-head RMSNorm on q and k (``q_norm``, ``k_norm``) before
RoPE, SwiGLU MLP.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.common.layers import RMSNorm, SwiGLU, apply_rope, rope_cos_sin
from draftsmith.drafters.dflash_config import DFlashConfig
from draftsmith.drafters.dflash_heads import MarkovHead, confidence_input
from draftsmith.export.exportable import Exportable

ContextKV = list[
    tuple[torch.Tensor, torch.Tensor]
]  # per layer (key, value), each [B, n_kv, C, head_dim], RoPE'd


def initial_output_gain(lm_head_weight: torch.Tensor) -> float:
    """The output norm's initial gain: min(1, 1 / mean row norm of the LM head [V, H]), so a random
    unit-RMS state's logits have std <= ~1 (initial cross-entropy ~ ln V instead of far above it).
    Never above 1: a head with short rows (a flat teacher, e.g. a random tiny target) keeps the
    plain gain rather than starting sharper than it.
    """
    rows = torch.linalg.vector_norm(lm_head_weight.detach(), dim=-1, dtype=torch.float32)  # [V]
    return min(1.0, 1.0 / float(rows.mean().clamp_min(1e-6)))


class DFlashAttention(nn.Module):
    """GQA attention whose keys/values are the context features' followed by the block's own (Qwen3
    q/k norms)."""

    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def key_value(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, H] (context features or normed block states) -> (k, v) [B, n_kv, S, d], k normed
        and RoPE'd."""
        bsz, seq, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(bsz, seq, self.c.num_kv_heads, -1)).transpose(
            1, 2
        )  # [B, nkv, S, d]
        v = self.v_proj(x).view(bsz, seq, self.c.num_kv_heads, -1).transpose(1, 2)  # [B, nkv, S, d]
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [B, S, H] block states, ctx_k/ctx_v [B, nkv, C, d], mask [B|1, 1, S, C+S] bool or None
        -> [B, S, H]."""
        bsz, seq, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(bsz, seq, self.c.num_heads, -1)).transpose(
            1, 2
        )  # [B, nh, S, d]
        q = apply_rope(q, cos, sin)
        k, v = self.key_value(x, cos, sin)
        keys, values = (
            torch.cat((ctx_k, k), dim=2),
            torch.cat((ctx_v, v), dim=2),
        )  # [B, nkv, C+S, d]
        groups = self.c.num_heads // self.c.num_kv_heads
        # training: explicit copies (SDPA's GQA flag has no backward here)
        if torch.is_grad_enabled() and groups > 1:
            keys, values = (
                keys.repeat_interleave(groups, dim=1),
                values.repeat_interleave(groups, dim=1),
            )
            groups = 1
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=groups > 1
        )  # [B, nh, S, d]
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))


class DFlashLayer(nn.Module):
    """Pre-norm decoder layer: attention over (context, block) keys, then SwiGLU."""

    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DFlashAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [B, S, H] -> [B, S, H]."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv[0], kv[1], mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(Exportable, nn.Module):
    """DFlash drafter; the target's embedding and LM head are frozen non-persistent buffers (never
    exported)."""

    method = "dflash"
    config_class = DFlashConfig
    target_weights = ("embed_weight", "lm_head_weight")
    self_drafting = False

    def __init__(
        self, config: DFlashConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor
    ) -> None:
        super().__init__()
        self.config = c = config
        self.fc = nn.Linear(len(c.target_layers) * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(c) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # P(slot k accepted | slots < k accepted) from (LM-head input, embedding of the drafted
        # token): 2H -> 1.
        self.confidence_head = nn.Linear(2 * c.hidden_size, 1) if c.confidence_head else None
        self.markov_head = MarkovHead(c.hidden_size, c.markov_rank) if c.markov_head else None
        for name, weight in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
            if tuple(weight.shape) != (c.vocab_size, c.hidden_size):
                raise ValueError(
                    f"{name} has shape {tuple(weight.shape)}, expected"
                    f" {(c.vocab_size, c.hidden_size)}: pass the weight of the target this drafter"
                    " was built for"
                )
            self.register_buffer(name, weight.detach(), persistent=False)
        # why: the shared LM head's rows are long (SmolLM2: |w_v| ~ 3.2), so a gain of 1 on a
        with torch.no_grad():
            # random unit-RMS state gives logits of std ~|w_v|: initial CE ~20 > ln V = 10.8, and
            # early training only un-learns that confidence. Gain 1/mean|w_v| (<= 1) gives logit std
            # ~1, initial CE ~ ln V.
            self.norm.weight.fill_(initial_output_gain(lm_head_weight))

    @property
    def tapped_layers(self) -> tuple[int, ...]:
        """Target layers (HF ``hidden_states`` indices) the drafter reads, in ``fc`` order."""
        return tuple(self.config.target_layers)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (an RMSNorm weight stays a parameter when the runtime packs the
        linears)."""
        return self.norm.weight.dtype

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(
            positions, self.config.head_dim, self.config.rope_theta, self.dtype
        )  # [B, S, d] each

    def context(self, taps: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """Target taps [B, C, n_taps*H_t] at RoPE ``positions`` [B, C] -> every layer's context
        (key, value)."""
        ctx = self.hidden_norm(self.fc(taps.to(self.dtype)))  # [B, C, H]
        cos, sin = self._rope(positions)
        return [layer.self_attn.key_value(ctx, cos, sin) for layer in self.layers]

    def block_tokens(self, verified: torch.Tensor) -> torch.Tensor:
        """verified [B] -> block input ids [B, block_size]: the verified token, then mask tokens."""
        block = verified.new_full(
            (verified.shape[0], self.config.block_size), self.config.mask_token_id
        )
        block[:, 0] = verified
        return block

    def block_forward(
        self,
        block_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ContextKV,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """block_ids [B, S] at ``positions`` [B, S] over ``ctx`` -> pre-norm states [B, S, H].

        ``mask`` [B|1, 1, S, C+S] bool (True = attend) over context then block keys; None = every
        key (one block over its whole context: the serving case).
        """
        x = F.embedding(block_ids, self.embed_weight).to(self.dtype)  # [B, S, H]
        cos, sin = self._rope(positions)
        for layer, kv in zip(self.layers, ctx):
            x = layer(x, cos, sin, kv, mask)
        return x

    def head_input(
        self, hidden: torch.Tensor, prev_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """LM-head input [..., H]: ``norm(hidden)``, plus the Markov term of the previous slot's
        token ``prev_ids`` [...] when the drafter has a Markov head (required then)."""
        normed = self.norm(hidden)
        if self.markov_head is None:
            return normed
        if prev_ids is None:
            raise ValueError(
                "this DFlash drafter has a Markov head: pass the previous slot's token ids"
            )
        return normed + self.markov_head(F.embedding(prev_ids, self.embed_weight).to(normed.dtype))

    def logit_parts(self, head_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(LM-head input [..., H], frozen target LM-head weight [V, H]) for a fused linear + CE."""
        return head_in, self.lm_head_weight

    def logits(self, head_in: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] through the target's LM head."""
        w = self.lm_head_weight
        return F.linear(head_in, w if w.dtype == head_in.dtype else w.to(head_in.dtype))

    def confidence_logit(self, head_in: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Logit of P(slot accepted | earlier slots accepted) [...] for the drafted ``token_ids``
        [...]."""
        if self.confidence_head is None:
            raise ValueError(
                "this DFlash drafter has no confidence head (drafter.confidence_head=false)"
            )
        emb = F.embedding(token_ids, self.embed_weight).to(head_in.dtype)
        return self.confidence_head(confidence_input(head_in, emb)).squeeze(-1)

    @torch.no_grad()
    def draft_greedy(
        self, taps: torch.Tensor, verified: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block from scratch (tests, reference): taps [B, C, n*H_t] at positions 0..C-1,
        verified [B] at C -> (greedy ids [B, block_size-1], logits [B, block_size-1, V]); the Markov
        term feeds each slot its predecessor's greedy token."""
        bsz, c = taps.shape[:2]
        ctx = self.context(taps, torch.arange(c, device=taps.device).expand(bsz, c))
        block = self.block_tokens(verified)
        pos = torch.arange(c, c + self.config.block_size, device=taps.device).expand(
            bsz, -1
        )  # [B, S]
        hidden = self.block_forward(block, pos, ctx)  # [B, S, H]
        prev, ids, logits = verified, [], []
        for k in range(1, self.config.block_size):
            row = self.logits(self.head_input(hidden[:, k], prev))  # [B, V]
            prev = row.argmax(-1)
            ids.append(prev)
            logits.append(row)
        return torch.stack(ids, 1), torch.stack(logits, 1)

    def architecture(self) -> dict[str, Any]:
        """Architecture block of the export config."""
        arch = asdict(self.config)
        arch["target_layers"] = list(self.config.target_layers)
        return arch


__all__ = [
    "ContextKV",
    "DFlashDrafter",
    "initial_output_gain",
]
