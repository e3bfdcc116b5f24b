"""What the EAGLE proposer (runtime/drafting/eagle_proposer.py) drafts through: the
:class:`DraftModel` contract, and :class:`ServingDraftModel`, the serving form of a one-layer EAGLE
drafter (static KV cache, RoPE tables, the layer in torch or as one fused CPU kernel call) that the
EAGLE-1 and EAGLE-3 adapters (runtime/drafting/eagle_adapters.py) share."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.common.layers import KVCache, apply_rope, build_attention_mask, rope_cos_sin
from draftsmith.runtime.drafting import eagle_native
from draftsmith.runtime.drafting.eagle_native import (
    full_mask,
    fused_linear,
    norm_weight,
    pack_linear,
)
from draftsmith.runtime.drafting.eagle_ops import (
    StaticDraftKV,
    grouped_attention,
    norm_linear_topk_reference,
    rms_norm,
    torch_topk,
)


class DraftModel:
    """What the proposer needs from a drafter, every member declared (adapters below; tests subclass
    it with stubs).
    ``step_topk``: None, or ``(hidden, ids, cache, positions, tree_mask, last_only, k) -> (out,
    log-probs [S', k], draft ids [S', k], cache)``, the head reduced to its top k without the [S',
    N] logits (the proposer uses it when an adapter has it); ``native_plan``: which parts of a draft
    call run natively, and why the others do not.
    """

    feature_taps: tuple[int, ...] = ()  # target layer taps to feed; () = the post-norm final hidden
    vocab_size: int  # target vocabulary
    # target id of each draft-vocab id [N], None = same vocabulary
    draft_ids: torch.Tensor | None = None
    step_topk: Callable[..., tuple] | None = None
    native_plan: Mapping[str, str] = MappingProxyType({})

    def features(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features [S, F] -> drafter input hidden [1, S, H]."""
        raise NotImplementedError(f"{type(self).__name__} must define features()")

    def step(
        self,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        cache: KVCache | None,
        positions: torch.Tensor | None,
        tree_mask: torch.Tensor | None,
        last_only: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        """hidden [1, S, H], target ids [1, S] -> (out [1, S, H], logits [1, S or 1, N], cache)."""
        raise NotImplementedError(f"{type(self).__name__} must define step()")


class ServingDraftModel(DraftModel):
    """The serving form of a one-layer EAGLE drafter (subclasses: EAGLE-1 and EAGLE-3 in
    runtime/drafting/eagle_adapters.py).

    Keys/values live in a :class:`StaticDraftKV`, RoPE rows come from tables built once (grown on
    demand). In bf16 on a CPU that builds the fused kernel (``kernels/cpu_decoder_layer.cpp``) a
    draft call is: the fc (``linear``), the layer (one native call), and the head as
    ``norm_linear_topk`` (norm, head GEMM, softmax, top-k: no [S, N] logits). Elsewhere the same
    math runs in torch with q/k/v in one linear and gate/up in another. ``native_plan`` says which
    parts run natively and, for each part that does not, why (nothing falls back silently);
    ``fused_reason`` is None when the layer runs natively.
    """

    draft_ids: torch.Tensor | None = None

    def __init__(
        self, drafter: nn.Module, head_norm: nn.Module | None, head: nn.Module | Any, head_n: int
    ) -> None:
        self.drafter = drafter.eval()
        self.vocab_size = drafter.config.vocab_size
        attn, mlp = drafter.layer.self_attn, drafter.layer.mlp
        self._kernel, self.fused_reason = eagle_native.draft_kernel(drafter)
        # [P, d] RoPE rows of positions 0..P-1, the drafter's dtype
        self._cos = self._sin = self._signed_sin = None
        self.native_plan = {
            "draft_layer": "native" if self._kernel else f"torch: {self.fused_reason}"
        }
        self._qkv = self._gate_up = None  # the torch layer's fused linears, built on its first use
        if self._kernel is None:
            self.native_plan["draft_head"] = f"torch: {self.fused_reason}"
            return
        self._layer_w = (
            pack_linear(attn.q_proj, attn.k_proj, attn.v_proj)[0],
            pack_linear(attn.o_proj)[0],
            norm_weight(drafter.layer.post_attention_layernorm),
            pack_linear(mlp.gate_proj, mlp.up_proj)[0],
            pack_linear(mlp.down_proj)[0],
        )
        self._head_args = (
            None if head_norm is None else norm_weight(head_norm),
            drafter.config.rms_norm_eps,
            pack_linear(head)[0],
            head_n,
        )  # norm_linear_topk's (norm_w, eps, packed_w, n)
        self._topk = getattr(self._kernel, "norm_linear_topk", None)
        self.native_plan["draft_head"] = (
            "native (norm_linear_topk)"
            if self._topk
            else (
                "linear in C++, softmax + top-k in torch: this build of the kernel has no"
                " norm_linear_topk"
            )
        )
        if self._topk is None:
            kernel = self._kernel
            self._topk = lambda *a: norm_linear_topk_reference(*a, linear=kernel.linear)

    def _grow_rope(self, needed: int, device: torch.device) -> None:
        """RoPE tables [P, d] for positions 0..P-1 with P >= ``needed``, grown by doubling."""
        if self._cos is None or self._cos.shape[0] < needed:
            c, dtype = self.drafter.config, self._dtype
            size = max(needed, 256, 2 * (0 if self._cos is None else self._cos.shape[0]))
            table = torch.arange(size, device=device)[None]  # [1, P]
            cos, sin = rope_cos_sin(table, c.head_dim, c.rope_theta, dtype)  # [1, P, d] each
            self._cos, self._sin = cos[0], sin[0]
            half = c.head_dim // 2  # the native layer folds rotate_half's sign into its sin table
            self._signed_sin = torch.cat(
                [-self._sin[:, :half], self._sin[:, half:]], dim=-1
            )  # [P, d]

    def _rope(self, positions: torch.Tensor, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [1, S, d] of ``positions`` [1, S] (all < ``needed``)."""
        self._grow_rope(needed, positions.device)
        return self._cos[positions], self._sin[positions]  # [1, S, d]

    @property
    def _dtype(self) -> torch.dtype:
        return self.drafter.fc.weight.dtype

    def _layer(
        self,
        x: torch.Tensor,
        res: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: StaticDraftKV,
    ) -> torch.Tensor:
        """The torch layer: q/k/v over x [1, S, in], residual res [1, S, H], over ``cache`` -> out
        [1, S, H]."""
        layer, c = self.drafter.layer, self.drafter.config
        seq, nh, nkv, hd = x.shape[1], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        if self._qkv is None:
            attn, mlp = layer.self_attn, layer.mlp
            self._qkv = fused_linear(attn.q_proj, attn.k_proj, attn.v_proj)  # in -> (nh + 2 nkv) d
            self._gate_up = fused_linear(mlp.gate_proj, mlp.up_proj)  # H -> 2I
        q, k, v = self._qkv(x).split(
            [nh * hd, nkv * hd, nkv * hd], dim=-1
        )  # [1, S, nh*d], [1, S, nkv*d] x2
        q = apply_rope(q.view(1, seq, nh, hd).transpose(1, 2), cos, sin)  # [1, nh, S, d]
        k = apply_rope(k.view(1, seq, nkv, hd).transpose(1, 2), cos, sin)  # [1, nkv, S, d]
        cache.append(k, v.view(1, seq, nkv, hd).transpose(1, 2))
        out = grouped_attention(q, cache.key, cache.value, mask)  # [1, nh, S, d]
        res = res + layer.self_attn.o_proj(
            out.transpose(1, 2).reshape(1, seq, nh * hd)
        )  # [1, S, H]
        gate, up = self._gate_up(rms_norm(layer.post_attention_layernorm, res)).chunk(
            2, dim=-1
        )  # [1, S, I] x2
        return res + layer.mlp.down_proj(F.silu(gate) * up)

    def _run(
        self,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        cache: StaticDraftKV | None,
        positions: torch.Tensor | None,
        tree_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, StaticDraftKV]:
        """The layer over ``cache`` (a new one when None): hidden [1, S, H], ids [1, S] -> (out [1,
        S, H], cache)."""
        c, seq = self.drafter.config, ids.shape[1]
        if cache is None:  # a new generation: storage for the prompt's pairs and room to grow
            like = torch.empty(
                1, c.num_key_value_heads, 0, c.head_dim, dtype=self._dtype, device=ids.device
            )
            cache = StaticDraftKV(like, 2 * seq + 64)
        past = cache.length
        needed = past + seq if positions is None else int(positions.max()) + 1
        if self._kernel is not None and self._native_ok(tree_mask):
            self._grow_rope(needed, ids.device)
            if positions is None:  # consecutive positions: the table rows are a view, no gather
                cos, sin = self._cos[past:needed], self._signed_sin[past:needed]  # [S, d] each
            else:  # the kernel reads sin with rotate_half's sign folded in
                cos, sin = (
                    self._cos.index_select(0, positions[0]),
                    self._signed_sin.index_select(0, positions[0]),
                )
            cache.reserve(
                past + seq
            )  # the kernel writes the new keys/values at slots past .. past+S-1
            # No mask: causal among the new rows, every cached one visible; a tree step's mask
            # covers every slot.
            full = None if tree_mask is None else full_mask(tree_mask, seq, past)  # [S, P+S]
            emb = F.embedding(ids[0], self.drafter.embed_weight).to(self._dtype)  # [S, H]
            out = self._native_layer(
                emb, hidden[0].contiguous(), cache, past, cos, sin, full
            )  # [S, H]
            cache.length = past + seq
            return out[None], cache
        if positions is None:
            positions = torch.arange(past, needed, device=ids.device)[None]  # [1, S]
        emb = F.embedding(ids, self.drafter.embed_weight).to(self._dtype)  # [1, S, H]
        one_query = seq == 1 and tree_mask is None  # one new query sees every key: no mask to build
        # [1, 1, S, P+S]
        mask = None if one_query else build_attention_mask(seq, past, ids.device, tree_mask)
        x, res = self._layer_input(emb, hidden)
        return self._layer(x, res, *self._rope(positions, needed), mask, cache), cache

    def _native_ok(self, tree_mask: torch.Tensor | None) -> bool:
        return True

    def step(
        self,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        cache: KVCache | None,
        positions: torch.Tensor | None,
        tree_mask: torch.Tensor | None,
        last_only: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        """hidden [1, S, H], target ids [1, S] -> (out [1, S, H], logits [1, S or 1, N], cache).
        Only the rows that draft (the last one of a root step, every frontier node of a tree step)
        go through the head.
        """
        out, cache = self._run(hidden, ids, cache, positions, tree_mask)
        return out, self._logits(out[:, -1:] if last_only else out), cache  # [1, 1 or S, N]

    def step_topk(
        self,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        cache: KVCache | None,
        positions: torch.Tensor | None,
        tree_mask: torch.Tensor | None,
        last_only: bool,
        k: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, KVCache]:
        """:meth:`step` with the head reduced to its top ``k``: (out [1, S, H], log-probs [S', k]
        fp32 descending, draft ids [S', k], cache), S' = 1 or S. Natively no [S', N] logits are
        made."""
        # the torch head on the logits (through self.step, which tests may override)
        if self._kernel is None:
            out, logits, cache = self.step(hidden, ids, cache, positions, tree_mask, last_only)
            return (out, *torch_topk(logits[0], k), cache)
        out, cache = self._run(hidden, ids, cache, positions, tree_mask)
        rows = (out[0, -1:] if last_only else out[0]).contiguous()  # [S', H]
        probs, top = self._topk(rows, *self._head_args, k)  # [S', k] fp32, [S', k] long
        return out, probs.log(), top, cache
