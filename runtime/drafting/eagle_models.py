"""The drafter adapters the EAGLE proposer (runtime/drafting/eagle.py) drafts through: EAGLE-1 and EAGLE-3."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.common.layers import KVCache, apply_rope, build_attention_mask, rope_cos_sin
from draftsmith.drafters.eagle import EagleDrafter
from draftsmith.drafters.eagle3 import Eagle3Drafter
from draftsmith.runtime.target.fast_linear import accelerate_linears


class StaticDraftKV:
    """The draft layer's keys and values in preallocated storage ``[1, n_kv, capacity, d]`` with a length counter.

    Drop-in for :class:`draftsmith.common.layers.KVCache` in the runtime (``length``, ``key``, ``value``,
    ``append``, ``crop``), but mutable: ``append`` writes after ``length`` in place (the storage doubles when full)
    and ``crop`` only resets ``length``, where the immutable cache copied its whole history with ``torch.cat`` on
    every drafter call (quadratic over a generation). Both return the cache itself, so the proposer's
    ``cache = cache.crop(n)`` / ``cache.append(k, v)`` pattern reads the same.
    """

    def __init__(self, like: torch.Tensor, capacity: int = 256) -> None:
        shape = (1, like.shape[1], max(1, capacity), like.shape[3])  # [1, n_kv, capacity, d]
        self._k = torch.empty(shape, dtype=like.dtype, device=like.device)
        self._v = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.length = 0

    @property
    def capacity(self) -> int:
        """Entries that fit before the storage grows."""
        return self._k.shape[2]

    @property
    def key(self) -> torch.Tensor:
        """The keys so far [1, n_kv, length, d] (a view)."""
        return self._k[:, :, : self.length]

    @property
    def value(self) -> torch.Tensor:
        """The values so far [1, n_kv, length, d] (a view)."""
        return self._v[:, :, : self.length]

    def reserve(self, size: int) -> None:
        """Make room for ``size`` entries in all, keeping the current ones (doubling: amortised O(1) per entry)."""
        if size > self.capacity:
            grown = StaticDraftKV(self._k, max(size, 2 * self.capacity))
            grown._k[:, :, : self.length] = self.key
            grown._v[:, :, : self.length] = self.value
            self._k, self._v = grown._k, grown._v

    def append(self, key: torch.Tensor, value: torch.Tensor) -> StaticDraftKV:
        """Write ``key``/``value`` [1, n_kv, S, d] after the current entries."""
        end = self.length + key.shape[2]
        self.reserve(end)
        self._k[:, :, self.length : end] = key
        self._v[:, :, self.length : end] = value
        self.length = end
        return self

    def crop(self, length: int) -> StaticDraftKV:
        """Keep the first ``length`` entries (drop this step's speculative ones): only the counter moves."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a draft KV cache of length {self.length} to {length}")
        self.length = length
        return self


class DraftModel(Protocol):
    """What the proposer needs from a drafter (adapters below; tests use stubs)."""

    feature_taps: tuple[int, ...]  # target layer taps to feed; () = the post-norm final hidden
    vocab_size: int  # target vocabulary
    draft_ids: torch.Tensor | None  # target id of each draft-vocab id [N], None = same vocabulary

    def features(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features [S, F] -> drafter input hidden [1, S, H]."""
        ...

    def step(self, hidden: torch.Tensor, ids: torch.Tensor, cache: KVCache | None, positions: torch.Tensor | None,
             tree_mask: torch.Tensor | None, last_only: bool) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        """hidden [1, S, H], target ids [1, S] -> (out [1, S, H], logits [1, S or 1, N], cache)."""
        ...


class Eagle1DraftModel:
    """EAGLE-1 adapter: features are the target's post-norm hidden; logits through the target's LM head."""

    feature_taps: tuple[int, ...] = ()
    draft_ids = None

    def __init__(self, drafter: EagleDrafter, head: Any = None) -> None:
        self.drafter = drafter.eval()
        self.vocab_size = drafter.config.vocab_size
        self.head = head or drafter.logits  # the target's own (packed, faster) head when it offers one

    def features(self, feats: torch.Tensor) -> torch.Tensor:
        return feats[None]  # [1, S, H]

    def step(self, hidden: torch.Tensor, ids: torch.Tensor, cache: KVCache | None, positions: torch.Tensor | None,
             tree_mask: torch.Tensor | None, last_only: bool) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        out, cache = self.drafter(ids, hidden, past_kv=cache, positions=positions, tree_mask=tree_mask)  # [1, S, H]
        return out, self.head(out[:, -1:] if last_only else out), cache  # the V-wide head on needed rows


class Eagle3DraftModel:
    """EAGLE-3 adapter: features are the fused layer taps; own LM head over the draft vocabulary.

    Its ``step`` is the drafter layer's math (``Eagle3Layer``) arranged for serving: keys/values in a
    :class:`StaticDraftKV` and RoPE rows read from tables built once (grown on demand). In bf16 on a CPU that builds
    the fused kernel (``kernels/cpu_decoder_layer.cpp``) the whole layer is one native call (``eagle3_layer``: both
    input norms, q/k/v, RoPE, the cache write, attention, o-proj, the MLP); elsewhere it runs in torch with q/k/v in
    one linear and gate/up in another. ``fused_reason`` says why the native layer does not run (None when it does).
    """

    def __init__(self, drafter: Eagle3Drafter) -> None:
        self.drafter = drafter.eval()
        self.feature_taps = tuple(drafter.config.target_layers)
        self.vocab_size = drafter.config.vocab_size
        full = drafter.config.draft_vocab_size == drafter.config.vocab_size
        self.draft_ids = None if full else drafter.draft_ids_in_target()  # [N]
        layer = drafter.layer
        attn, mlp = layer.self_attn, layer.mlp
        self._kernel, self.fused_reason = _draft_kernel(drafter)
        if self._kernel is not None:
            from draftsmith.kernels.cpu_layer import pack_weight

            def norm(m: nn.Module) -> torch.Tensor:
                return m.weight.detach().contiguous()

            def packed(*parts: nn.Module) -> torch.Tensor:
                return pack_weight(torch.cat([p.weight.detach() for p in parts]))  # [blocks, in/2, 32]

            self._native = (norm(layer.input_layernorm), norm(layer.hidden_norm),
                            packed(attn.q_proj, attn.k_proj, attn.v_proj), packed(attn.o_proj),
                            norm(layer.post_attention_layernorm), packed(mlp.gate_proj, mlp.up_proj),
                            packed(mlp.down_proj))  # fmt: skip
        else:
            self._qkv = _fused_linear(attn.q_proj, attn.k_proj, attn.v_proj)  # 2H -> (nh + 2 nkv) d
            self._gate_up = _fused_linear(mlp.gate_proj, mlp.up_proj)  # H -> 2I
        self._cos = self._sin = self._signed_sin = None  # [P, d] RoPE rows of positions 0..P-1, the drafter's dtype

    def _rope(self, positions: torch.Tensor, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [1, S, d] of ``positions`` [1, S] (all < ``needed``), from tables grown by doubling."""
        if self._cos is None or self._cos.shape[0] < needed:
            c, dtype = self.drafter.config, self.drafter.fc.weight.dtype
            size = max(needed, 256, 2 * (0 if self._cos is None else self._cos.shape[0]))
            table = torch.arange(size, device=positions.device)[None]  # [1, P]
            cos, sin = rope_cos_sin(table, c.head_dim, c.rope_theta, dtype)  # [1, P, d] each
            self._cos, self._sin = cos[0], sin[0]
            half = c.head_dim // 2  # the native layer folds rotate_half's sign into its sin table
            self._signed_sin = torch.cat([-self._sin[:, :half], self._sin[:, half:]], dim=-1)  # [P, d]
        return self._cos[positions], self._sin[positions]  # [1, S, d]

    def _native_layer(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, needed: int,
                      tree_mask: torch.Tensor | None, cache: StaticDraftKV) -> torch.Tensor:
        """The same layer as :meth:`_layer` in one call of the fused kernel: emb, hidden [1, S, H] -> [1, S, H]."""
        c, seq, past = self.drafter.config, emb.shape[1], cache.length
        cache.reserve(past + seq)  # the kernel writes the new keys/values at slots past .. past+S-1
        # No mask: causal among the new rows, every cached one visible; a tree step's mask covers every slot.
        full = None if tree_mask is None else build_attention_mask(seq, past, emb.device, tree_mask)[0, 0]  # [S, P+S]
        self._rope(positions, needed)
        rows = positions[0]
        out = self._kernel.eagle3_layer(
            emb[0].contiguous(), hidden[0].contiguous(), *self._native, cache._k[0], cache._v[0], past,
            self._cos.index_select(0, rows), self._signed_sin.index_select(0, rows),  # [S, d] each
            None, None if full is None else full.contiguous(), c.num_attention_heads, c.num_key_value_heads,
            c.rms_norm_eps, c.head_dim**-0.5)  # [S, H]
        cache.length = past + seq
        return out[None]

    def _layer(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, needed: int,
               mask: torch.Tensor | None, cache: StaticDraftKV) -> torch.Tensor:
        """Eagle3Layer.forward over ``cache`` (see the class docstring): emb, hidden [1, S, H] -> out [1, S, H]."""
        layer, c = self.drafter.layer, self.drafter.config
        seq, nh, nkv, hd = emb.shape[1], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        x = torch.cat((_rms_norm(layer.input_layernorm, emb), _rms_norm(layer.hidden_norm, hidden)), -1)  # [1, S, 2H]
        q, k, v = self._qkv(x).split([nh * hd, nkv * hd, nkv * hd], dim=-1)  # [1, S, nh*d], [1, S, nkv*d] x2
        cos, sin = self._rope(positions, needed)  # [1, S, d]
        q = apply_rope(q.view(1, seq, nh, hd).transpose(1, 2), cos, sin)  # [1, nh, S, d]
        k = apply_rope(k.view(1, seq, nkv, hd).transpose(1, 2), cos, sin)  # [1, nkv, S, d]
        cache.append(k, v.view(1, seq, nkv, hd).transpose(1, 2))
        out = grouped_attention(q, cache.key, cache.value, mask)  # [1, nh, S, d]
        hidden = hidden + layer.self_attn.o_proj(out.transpose(1, 2).reshape(1, seq, nh * hd))  # [1, S, H]
        gate, up = self._gate_up(_rms_norm(layer.post_attention_layernorm, hidden)).chunk(2, dim=-1)  # [1, S, I] x2
        return hidden + layer.mlp.down_proj(F.silu(gate) * up)

    def features(self, feats: torch.Tensor) -> torch.Tensor:
        return self.drafter.fuse(feats[None])  # [1, S, k*H] -> [1, S, H]

    def step(self, hidden: torch.Tensor, ids: torch.Tensor, cache: KVCache | None, positions: torch.Tensor | None,
             tree_mask: torch.Tensor | None, last_only: bool) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        # Eagle3Drafter.draft_step without its head: the root step feeds every pending prompt row, but only the
        # last one drafts, so only that row (or the frontier rows of a tree step) goes through norm + lm_head.
        d, seq = self.drafter, ids.shape[1]
        if cache is None:  # a new generation: storage for the prompt's pairs and room to grow
            c = d.config
            like = torch.empty(1, c.num_key_value_heads, 0, c.head_dim, dtype=d.fc.weight.dtype, device=ids.device)
            cache = StaticDraftKV(like, 2 * seq + 64)
        past = cache.length
        if positions is None:
            positions, needed = torch.arange(past, past + seq, device=ids.device)[None], past + seq  # [1, S]
        else:
            needed = int(positions.max()) + 1
        emb = F.embedding(ids, d.embed_weight).to(d.fc.weight.dtype)  # [1, S, H]
        if self._kernel is not None:
            out = self._native_layer(emb, hidden, positions, needed, tree_mask, cache)  # [1, S, H]
        else:
            # One new query sees every key: no mask to build.
            one_query = seq == 1 and tree_mask is None
            mask = None if one_query else build_attention_mask(seq, past, ids.device, tree_mask)  # [1, 1, S, P+S]
            out = self._layer(emb, hidden, positions, needed, mask, cache)  # [1, S, H]
        rows = out[:, -1:] if last_only else out  # [1, 1 or S, H]
        return out, d.lm_head(_rms_norm(d.norm, rows)), cache  # [1, 1 or S, N]


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``common.layers.RMSNorm`` (normalise in fp32, round to x's dtype, scale) in 3 ops instead of 7."""
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), None, norm.eps).to(x.dtype)


def grouped_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention of q [1, nh, S, d] over key/value [1, nkv, L, d] (query head h reads kv head h // (nh/nkv),
    as SDPA's ``enable_gqa``), mask [1, 1, S, L] bool (True = attend) or None, in fp32 -> [1, nh, S, d].

    A drafting step has 1-16 queries: each kv head's group of query heads becomes the rows of one batched matmul.
    bf16 SDPA with GQA took a slow path on CPU (~0.18 ms against ~0.05 ms for one query over 200 keys, 2-core Zen 4
    under load)."""
    nh, seq, hd = q.shape[1:]
    nkv, length = key.shape[1], key.shape[2]
    rows = q[0].reshape(nkv, nh // nkv * seq, hd).float()  # [nkv, g*S, d]: heads kv*g .. kv*g+g-1 share kv head kv
    scores = torch.bmm(rows, key[0].float().transpose(1, 2)).mul_(hd**-0.5)  # [nkv, g*S, L]
    if mask is not None:
        scores.view(nkv, -1, seq, length).masked_fill_(~mask[0, 0], float("-inf"))  # [nkv, g, S, L]
    out = torch.bmm(torch.softmax(scores, dim=-1), value[0].float())  # [nkv, g*S, d]
    return out.view(1, nh, seq, hd).to(q.dtype)


def _draft_kernel(drafter: Eagle3Drafter) -> tuple[ModuleType | None, str | None]:
    """(the fused CPU kernel, None) when the draft layer can run natively (bf16 on a CPU that builds it, shapes it
    takes), else (None, why)."""
    from draftsmith.kernels import cpu_layer

    w, c = drafter.fc.weight, drafter.config
    if w.dtype != torch.bfloat16 or w.device.type != "cpu":
        return None, f"the fused draft layer runs bf16 on CPU; this drafter is {w.dtype} on {w.device.type}"
    why = cpu_layer.why_unavailable() or cpu_layer.shapes_supported(c.head_dim, c.hidden_size, c.intermediate_size)
    if why is None:
        try:
            return cpu_layer.load_cpu_layer(), None
        except cpu_layer.CpuLayerUnavailable as err:
            why = str(err)
    return None, why


def _fused_linear(*parts: nn.Module) -> nn.Module:
    """One bias-free linear whose output is the parts' outputs side by side (one GEMM call instead of several),
    packed for the CPU kernel when it runs here. Reads each part's ``weight`` (a packed linear keeps it)."""
    weight = torch.cat([p.weight.detach() for p in parts])  # [sum of outputs, in]
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    holder = nn.Sequential(fused)
    accelerate_linears(holder)  # swaps it for a packed linear where the fused CPU kernel runs (bf16 on x86)
    return holder[0]


__all__ = ["DraftModel", "Eagle1DraftModel", "Eagle3DraftModel", "StaticDraftKV"]
