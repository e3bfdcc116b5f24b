"""The lean decoder for models whose layers go beyond the plain Llama layer, in PyTorch ops.

Sliding-window layers (Mistral, Phi-3, Qwen2/3 with ``use_sliding_window``, Gemma's local layers)
attend under a window mask measured in positions, so the static cache keeps every position and a
context longer than the window is served exactly; Gemma-2/3 add scaled embeddings, (1 + w) RMSNorms
in fp32, sandwich norms, a GELU-tanh MLP, ``query_pre_attn_scalar``, attention and final logit
softcaps (Gemma-2), q/k norms and the local layers' own RoPE base (Gemma-3).
:class:`~draftsmith.runtime.target.model.LeanDecoder` builds this subclass by itself, once, when
``ModelConfig.llama_layer_gap`` names such a feature. The fused C++ layer lacks them: the linear
plan falls back to oneDNN or dense linears (forcing ``linear_backend='cpp'`` raises).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from draftsmith.kernels.attention import window_mask
from draftsmith.kernels.verify import target_argmax
from draftsmith.runtime.target.cache import KVCache
from draftsmith.runtime.target.linear_ops import choose_linear_ops
from draftsmith.runtime.target.model import LeanDecoder
from draftsmith.runtime.target.model_config import rope_inv_freq, rope_tables
from draftsmith.runtime.target.torch_layers import (
    LayerSpec,
    family_layer,
    gelu_tanh,
    gemma_rms_norm,
)


class FamilyDecoder(LeanDecoder):
    """A :class:`LeanDecoder` whose layers run
    :func:`~draftsmith.runtime.target.torch_layers.family_layer`: per-layer windows and RoPE tables,
    Gemma's norms and softcaps. Same interface, same cache."""

    def _build_exec(self) -> None:
        c = self.config
        ops, self.linear_plan = choose_linear_ops(
            self.linear_backend,
            self.dtype,
            self.device,
            (c.head_dim, c.hidden_size, c.intermediate_size),
            compiled=self._compile,
            unfused=f"the fused C++ layer lacks {c.llama_layer_gap}",
        )
        self._ops = ops
        self._norm = gemma_rms_norm if c.norm_plus_one else F.rms_norm
        spec = LayerSpec(
            ops.linear,
            self._norm,
            gelu_tanh if c.hidden_act == "gelu_pytorch_tanh" else F.silu,
            self.kernel_backend,
            c.num_heads,
            c.num_kv_heads,
            c.rms_norm_eps,
            c.attn_scale or c.head_dim**-0.5,
            c.attn_softcap,
        )
        self._layer = partial(family_layer, spec)
        self._exec = [
            (
                w.ln1,
                ops.pack(w.wqkv),
                w.bqkv,
                w.qn,
                w.kn,
                ops.pack(w.wo),
                w.bo,
                w.post_attn,
                w.ln2,
                ops.pack(w.wgu),
                w.bgu,
                ops.pack(w.wdown),
                w.bdown,
                w.post_ff,
            )
            for w in self.layers
        ]
        self._head = ops.pack_head(self.lm_head)
        self._embed_scale = None
        # transformers scales by the factor rounded to the model dtype
        if c.embed_scale is not None:
            self._embed_scale = torch.tensor(c.embed_scale, dtype=self.dtype, device=self.device)

    def _ensure_rope(self, n: int) -> None:
        if n <= self._rope_len:
            return
        super()._ensure_rope(n)
        self._cos_local, self._sin_local = self._cos, self._sin
        if self.config.local_rope_theta is not None:  # Gemma-3: the sliding layers' own base
            inv = rope_inv_freq(self.config, local=True)
            self._cos_local, self._sin_local = rope_tables(
                inv, self._rope_len, self.dtype, self.device
            )

    def allocate_cache(self, max_len: int) -> KVCache:
        """A static cache of ``max_len`` slots (batch 1) keeping every position: windows are applied
        by the mask, so a context longer than the window is exact."""
        return self.allocate_layer_cache(self.config.num_layers, max_len)

    def _run(
        self, input_ids, kv_layers, start, tree_mask, positions, logits_for, taps, head="logits"
    ):
        """The forward math (see :meth:`LeanDecoder.forward`); inputs are already validated."""
        c = self.config
        found: dict[int, torch.Tensor] = {}
        x = self._layers(
            self.embed_tokens(input_ids),
            0,
            c.num_layers,
            kv_layers,
            start,
            tree_mask,
            positions,
            taps,
            found,
        )
        if c.num_layers in taps:
            found[c.num_layers] = x
        hidden = self.final_hidden(x)  # [T, H]
        if self.config.final_softcap is None:
            logits, argmax = self._head_rows(hidden, logits_for, head)
            return logits, hidden, found, argmax
        # A softcap can round distinct logits to equal ones: the argmax is taken after it, on the
        # whole rows.
        logits = self._softcap(self._head_rows(hidden, logits_for, "logits")[0])  # [T', V]
        return (
            (None, hidden, found, target_argmax(logits))
            if head == "argmax"
            else (logits, hidden, found, None)
        )

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _layers(self, x, first, last, kv_layers, start, tree_mask, positions, taps=(), found=None):
        """Decoder layers ``first..last-1`` on x [T, H]: the window masks and RoPE rows are built
        once per forward and shared by the layers of the same kind."""
        c, t = self.config, x.shape[0]
        pos = (
            torch.arange(start, start + t, device=x.device)
            if positions is None
            else positions.to(x.device)
        )
        windows = c.layer_windows
        masks = {}
        for w in set(
            windows[first:last]
        ):  # None: global layers, masked only when they softcap their scores
            if w is not None or c.attn_softcap is not None:
                masks[w] = window_mask(start, tree_mask, pos, w)
        ropes = {
            False: (self._cos[pos], self._sin[pos]),
            True: (self._cos_local[pos], self._sin_local[pos]),
        }
        for i in range(first, last):
            if found is not None and i in taps:
                found[i] = x
            kc, vc = kv_layers[i]
            cos, sin = ropes[windows[i] is not None]
            x = self._layer(
                x, *self._exec[i], kc, vc, start, cos, sin, masks.get(windows[i]), tree_mask
            )
        return x

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._softcap(super().lm_head_logits(hidden))

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed)
        return x if self._embed_scale is None else x * self._embed_scale

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, (self.config.hidden_size,), self.norm_w, self.config.rms_norm_eps)
