"""The drafter adapters the EAGLE proposer (runtime/drafting/eagle.py) drafts through: EAGLE-1 and
EAGLE-3."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType, ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.common.layers import KVCache, apply_rope, build_attention_mask, rope_cos_sin
from draftsmith.drafters.eagle import EagleDrafter
from draftsmith.drafters.eagle3 import Eagle3Drafter
from draftsmith.runtime.drafting.eagle_ops import (  # noqa: F401  (StaticDraftKV, grouped_attention: re-exported)
    StaticDraftKV,
    grouped_attention,
    norm_linear_topk_reference,
    rms_norm,
    torch_topk,
)
from draftsmith.runtime.target.fast_linear import accelerate_linears


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
    draft_ids: torch.Tensor | None = (
        None  # target id of each draft-vocab id [N], None = same vocabulary
    )
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


class _ServingDraftModel(DraftModel):
    """The serving form of a one-layer EAGLE drafter (subclasses: EAGLE-1 and EAGLE-3).

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
        self._kernel, self.fused_reason = _draft_kernel(drafter)
        self._cos = self._sin = self._signed_sin = (
            None  # [P, d] RoPE rows of positions 0..P-1, the drafter's dtype
        )
        self.native_plan = {
            "draft_layer": "native" if self._kernel else f"torch: {self.fused_reason}"
        }
        self._qkv = self._gate_up = None  # the torch layer's fused linears, built on its first use
        if self._kernel is None:
            self.native_plan["draft_head"] = f"torch: {self.fused_reason}"
            return
        self._layer_w = (
            _packed(attn.q_proj, attn.k_proj, attn.v_proj)[0],
            _packed(attn.o_proj)[0],
            _weight(drafter.layer.post_attention_layernorm),
            _packed(mlp.gate_proj, mlp.up_proj)[0],
            _packed(mlp.down_proj)[0],
        )
        self._head_args = (
            None if head_norm is None else _weight(head_norm),
            drafter.config.rms_norm_eps,
            _packed(head)[0],
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
            self._qkv = _fused_linear(attn.q_proj, attn.k_proj, attn.v_proj)  # in -> (nh + 2 nkv) d
            self._gate_up = _fused_linear(mlp.gate_proj, mlp.up_proj)  # H -> 2I
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
            full = None if tree_mask is None else _full_mask(tree_mask, seq, past)  # [S, P+S]
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
        mask = (
            None if one_query else build_attention_mask(seq, past, ids.device, tree_mask)
        )  # [1, 1, S, P+S]
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
        if (
            self._kernel is None
        ):  # the torch head on the logits (through self.step, which tests may override)
            out, logits, cache = self.step(hidden, ids, cache, positions, tree_mask, last_only)
            return (out, *torch_topk(logits[0], k), cache)
        out, cache = self._run(hidden, ids, cache, positions, tree_mask)
        rows = (out[0, -1:] if last_only else out[0]).contiguous()  # [S', H]
        probs, top = self._topk(rows, *self._head_args, k)  # [S', k] fp32, [S', k] long
        return out, probs.log(), top, cache


class Eagle1DraftModel(_ServingDraftModel):
    """EAGLE-1 adapter: features are the target's post-norm hidden; logits through the target's LM
    head.

    Natively: ``linear`` (fc over concat(emb, feature), with its bias) then ``decoder_layer`` with
    ``ln1=None`` (the layer has no input norm), the head ``norm_linear_topk`` without a norm over
    the target's packed LM head (``packed_head``, shared with the target; packed here when not
    given). A tree step (whose nodes see only their own ancestors) passes ``decoder_layer`` a mask
    over every cached slot (``full_mask``), as EAGLE-3's native path does.
    """

    feature_taps: tuple[int, ...] = ()

    def __init__(self, drafter: EagleDrafter, head: Any = None, packed_head: Any = None) -> None:
        self.head = (
            head or drafter.logits
        )  # the target's own (packed, faster) head when it offers one
        source = packed_head if packed_head is not None else _HeadWeight(drafter.lm_head_weight)
        super().__init__(drafter, None, source, drafter.config.vocab_size)
        why = None if self._kernel is None else _optional_ln1(self._kernel)
        self._layer_native = self._kernel is not None and why is None
        self._tree_native = False
        if self._layer_native:
            self._fc = _packed(drafter.fc) + (
                drafter.config.hidden_size,
            )  # (packed [.., 2H/2, 32], bias, H)
            # A build from before decoder_layer took full_mask runs tree steps in torch (its nodes'
            # masks cover cached slots); the signature line names the argument.
            self._tree_native = (
                "full_mask" in (self._kernel.decoder_layer.__doc__ or "").split("\n")[0]
            )
            self.native_plan["draft_layer"] = (
                "native (chains, root and tree steps)"
                if self._tree_native
                else (
                    "native for chains and root steps; tree steps in torch: this build's"
                    " decoder_layer takes no full_mask"
                )
            )
        elif (
            why is not None
        ):  # an older build of the kernel: the layer runs in torch, the head natively
            self.native_plan["draft_layer"], self.fused_reason = f"torch: {why}", why

    def features(self, feats: torch.Tensor) -> torch.Tensor:
        return feats[None]  # [1, S, H]

    def _native_ok(self, tree_mask: torch.Tensor | None) -> bool:
        return self._layer_native and (tree_mask is None or self._tree_native)

    def _layer_input(
        self, emb: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.drafter.fc(
            torch.cat((emb, hidden.to(self._dtype)), dim=-1)
        )  # [1, S, 2H] -> [1, S, H]
        return z, z  # no input norm: q/k/v read z and the residual is z

    def _native_layer(
        self,
        emb: torch.Tensor,
        hidden: torch.Tensor,
        cache: StaticDraftKV,
        past: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        full: torch.Tensor | None,
    ) -> torch.Tensor:
        c, kern = self.drafter.config, self._kernel
        packed, bias, h = self._fc
        z = kern.linear(
            torch.cat((emb, hidden.to(self._dtype)), dim=-1), packed, bias, h
        )  # [S, 2H] -> [S, H]
        wqkv, wo, ln2, wgu, wdown = self._layer_w
        return kern.decoder_layer(
            z,
            None,
            wqkv,
            None,
            None,
            None,
            wo,
            None,
            ln2,
            wgu,
            None,
            wdown,
            None,
            cache._k[0],
            cache._v[0],
            past,
            cos,
            sin,
            None,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.rms_norm_eps,
            c.head_dim**-0.5,
            *(() if full is None else (full.contiguous(),)),
        )  # [S, H]; full [S, P+S]

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        return self.head(rows)  # the V-wide head on the needed rows


class Eagle3DraftModel(_ServingDraftModel):
    """EAGLE-3 adapter: features are the fused layer taps; own LM head over the draft vocabulary.

    Natively a draft call is ``linear`` (fc over the taps, once per accepted segment, in
    :meth:`features`), ``eagle3_layer`` (both input norms, q/k/v, RoPE, the cache write, attention,
    o-proj, the MLP) and ``norm_linear_topk`` (final norm, draft-vocabulary head, softmax, top-k);
    the proposer maps draft ids to target ids (d2t, one gather).
    """

    def __init__(self, drafter: Eagle3Drafter) -> None:
        super().__init__(drafter, drafter.norm, drafter.lm_head, drafter.config.draft_vocab_size)
        self.feature_taps = tuple(drafter.config.target_layers)
        full = drafter.config.draft_vocab_size == drafter.config.vocab_size
        self.draft_ids = None if full else drafter.draft_ids_in_target()  # [N]
        if self._kernel is not None:
            layer = drafter.layer
            self._norms = (_weight(layer.input_layernorm), _weight(layer.hidden_norm))
            self._fc = _packed(drafter.fc) + (
                drafter.config.hidden_size,
            )  # (packed [.., kH/2, 32], None, H)

    def features(self, feats: torch.Tensor) -> torch.Tensor:
        if self._kernel is None:
            return self.drafter.fuse(feats[None])  # [1, S, k*H] -> [1, S, H]
        packed, bias, h = self._fc
        return self._kernel.linear(feats.to(self._dtype).contiguous(), packed, bias, h)[
            None
        ]  # [1, S, H]

    def _layer_input(
        self, emb: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.drafter.layer
        x = torch.cat(
            (rms_norm(layer.input_layernorm, emb), rms_norm(layer.hidden_norm, hidden)), -1
        )  # [1, S, 2H]
        return x, hidden  # the residual is the hidden input

    def _native_layer(
        self,
        emb: torch.Tensor,
        hidden: torch.Tensor,
        cache: StaticDraftKV,
        past: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        full: torch.Tensor | None,
    ) -> torch.Tensor:
        c = self.drafter.config
        wqkv, wo, ln2, wgu, wdown = self._layer_w
        return self._kernel.eagle3_layer(
            emb,
            hidden,
            *self._norms,
            wqkv,
            wo,
            ln2,
            wgu,
            wdown,
            cache._k[0],
            cache._v[0],
            past,
            cos,
            sin,
            None,
            None if full is None else full.contiguous(),
            c.num_attention_heads,
            c.num_key_value_heads,
            c.rms_norm_eps,
            c.head_dim**-0.5,
        )  # [S, H]

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        d = self.drafter
        return d.lm_head(rms_norm(d.norm, rows))  # [1, S', N]


class _HeadWeight:
    """A bare [N, K] weight in the shape :func:`_packed` reads (``.weight``, no bias)."""

    bias = None

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight


def _draft_kernel(drafter: nn.Module) -> tuple[ModuleType | None, str | None]:
    """(the fused CPU kernel, None) when an EAGLE draft layer can run natively (bf16 on a CPU that
    builds it, shapes it takes), else (None, why)."""
    from draftsmith.kernels import cpu_layer

    w, c = drafter.fc.weight, drafter.config
    if w.dtype != torch.bfloat16 or w.device.type != "cpu":
        return (
            None,
            f"the fused draft layer runs bf16 on CPU; this drafter is {w.dtype} on {w.device.type}",
        )
    why = cpu_layer.why_unavailable() or cpu_layer.shapes_supported(
        c.head_dim, c.hidden_size, c.intermediate_size
    )
    if why is None:
        try:
            return cpu_layer.load_cpu_layer(), None
        except cpu_layer.CpuLayerUnavailable as err:
            why = str(err)
    return None, why


def _full_mask(tree_mask: torch.Tensor, seq: int, past: int) -> torch.Tensor:
    """The [S, P+S] bool mask of a tree step (build_attention_mask's, every node seeing itself), in
    3 ops when the caller already gives one over every slot (the proposer does) instead of about
    10."""
    if tuple(tree_mask.shape) != (seq, past + seq) or tree_mask.dtype != torch.bool:
        return build_attention_mask(seq, past, tree_mask.device, tree_mask)[0, 0].contiguous()
    full = tree_mask.clone(
        memory_format=torch.contiguous_format
    )  # never write into the caller's mask
    full[:, past:].diagonal().fill_(True)
    return full


def _optional_ln1(kernel: ModuleType) -> str | None:
    """None when the kernel's ``decoder_layer`` takes ``ln1=None`` (a layer without an input norm),
    else why not. pybind lists the arguments positionally: ``ln1`` is the second."""
    sig = (kernel.decoder_layer.__doc__ or "").split("\n")[0]
    ln1 = sig.split(", ")[1] if sig.count(", ") else ""
    if "None" in ln1 or "Optional" in ln1:
        return None
    return (
        "this build of the fused kernel's decoder_layer needs an input norm (ln1); EAGLE-1's layer"
        " has none"
    )


def _weight(norm: nn.Module) -> torch.Tensor:
    return norm.weight.detach().contiguous()


def _packed(*parts: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(packed weight [blocks, in/2, 32], bias or None) of one linear (its packing reused when it
    has one: a fast_linear.PackedLinear or the target's packed head), or of several side by side
    (bias-free).
    """
    from draftsmith.kernels.cpu_layer import pack_weight

    bias = getattr(parts[0], "bias", None) if len(parts) == 1 else None
    bias = None if bias is None else bias.detach().contiguous()
    if len(parts) == 1 and getattr(parts[0], "packed", None) is not None:
        return parts[0].packed, bias
    return (
        pack_weight(torch.cat([p.weight.detach() for p in parts])),
        bias,
    )  # [sum of outputs, in] packed


def _fused_linear(*parts: nn.Module) -> nn.Module:
    """One bias-free linear whose output is the parts' outputs side by side (one GEMM call instead
    of several), packed for the CPU kernel when it runs here. Reads each part's ``weight`` (a packed
    linear keeps it).
    """
    weight = torch.cat([p.weight.detach() for p in parts])  # [sum of outputs, in]
    fused = nn.Linear(
        weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype
    )
    fused.weight = nn.Parameter(weight, requires_grad=False)
    holder = nn.Sequential(fused)
    accelerate_linears(
        holder
    )  # swaps it for a packed linear where the fused CPU kernel runs (bf16 on x86)
    return holder[0]


__all__ = [
    "DraftModel",
    "Eagle1DraftModel",
    "Eagle3DraftModel",
    "StaticDraftKV",
    "grouped_attention",
    "torch_topk",
]
