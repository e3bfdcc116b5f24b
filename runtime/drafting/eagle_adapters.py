"""The EAGLE-1 and EAGLE-3 drafter adapters: what each feeds its layer (the target's final hidden
or its fused layer taps), which kernel call runs that layer natively, and which head drafts."""

from __future__ import annotations

from typing import Any

import torch

from draftsmith.drafters.eagle import EagleDrafter
from draftsmith.drafters.eagle3 import Eagle3Drafter
from draftsmith.runtime.drafting.eagle_models import ServingDraftModel
from draftsmith.runtime.drafting.eagle_native import (
    HeadWeight,
    norm_weight,
    optional_ln1,
    pack_linear,
)
from draftsmith.runtime.drafting.eagle_ops import StaticDraftKV, rms_norm


class Eagle1DraftModel(ServingDraftModel):
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
        # the target's own (packed, faster) head when it offers one
        self.head = head or drafter.logits
        source = packed_head if packed_head is not None else HeadWeight(drafter.lm_head_weight)
        super().__init__(drafter, None, source, drafter.config.vocab_size)
        why = None if self._kernel is None else optional_ln1(self._kernel)
        self._layer_native = self._kernel is not None and why is None
        self._tree_native = False
        if self._layer_native:
            self._fc = pack_linear(drafter.fc) + (
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
        # an older build of the kernel: the layer runs in torch, the head natively
        elif why is not None:
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


class Eagle3DraftModel(ServingDraftModel):
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
            self._norms = (norm_weight(layer.input_layernorm), norm_weight(layer.hidden_norm))
            self._fc = pack_linear(drafter.fc) + (
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
