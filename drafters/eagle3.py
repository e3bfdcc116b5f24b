"""EAGLE-3 drafter: fused low/mid/high target features, one decoder layer, own LM head over a
reduced vocab.

Pairs are aligned as for EAGLE-1 (drafters/eagle.py's module docstring): pair index ``t`` reads
``g_t = fc(concat(h^{l_1}_t, h^{l_2}_t, h^{l_3}_t))`` (pre-norm residual stream at the INPUT of
target layers ``l_i``, i.e. HF ``hidden_states[l_i]``, default ``(2, L//2, L-3)``) and the next
token ``x_{t+1}``. The layer's q/k/v read ``concat(input_layernorm(embed(x_{t+1})),
hidden_norm(g_t))`` (2h, embedding first); the residual is the un-normed ``g_t``; then
post-attention norm + SwiGLU. Its output ``a_t`` (pre-norm) goes through ``norm`` and ``lm_head`` (h
-> draft vocab) and predicts ``x_{t+2}``. Draft id ``d`` is target id ``d + d2t[d]``; ``t2d[v]``
says whether target token ``v`` is in the draft vocab.

Training-time test (``ttt_forward``): step 0 runs on ``g``; step ``j > 0`` feeds the drafter's own
``a`` (no fc) with the tokens shifted ``j`` more places; query ``t`` of step ``j`` (RoPE position
``t + j``) attends to step-0 keys ``<= t`` plus the keys of index ``t`` from steps ``1..j``. This
equals running ``draft_step`` step by step (tests/test_eagle3.py checks it).

Inference (``draft_step`` with the ``KVCache`` of drafters/eagle.py): prefill with ``fuse(target
layer features)`` of the accepted tokens paired with the following token; each further draft step
passes the previous output ``a`` (not fused) with the token drafted from it (converted to a target
id with ``draft_to_target``), at the next position. After verification crop the cache to the pairs
built from target features and feed the fused target features of the newly accepted tokens, exactly
as for EAGLE-1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.drafters.eagle import (
    DraftAttention,
    EagleConfig,
    KVCache,
    RMSNorm,
    SwiGLU,
    _frozen,
    build_attention_mask,
    default_positions,
)
from draftsmith.drafters.eagle3_ttt import TTTPast, step0_mask, ttt_attention
from draftsmith.export.exportable import Exportable, ExportContents
from draftsmith.export.format import ExportError


def default_target_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's taps: the inputs of target layers 2, L//2 and L-3 (HF hidden_states indices); a
    shallow target where those are not three distinct layers (L < 7) gets a low/mid/high spread of
    the layers it has instead (``(low, (low+L-1)//2, L-1)`` with ``low`` 1, or 0 for L = 3). Fewer
    than 3 layers raise ValueError.
    """
    layers = (2, num_layers // 2, num_layers - 3)
    if len(set(layers)) == 3 and layers[-1] > layers[-2]:
        return layers
    if num_layers < 3:
        raise ValueError(
            f"a {num_layers}-layer target has no three distinct layers for EAGLE-3's default taps;"
            " set drafter.target_layers explicitly, e.g."
            f" drafter.target_layers=[{', '.join(map(str, range(num_layers)))}]"
        )
    low, high = (1 if num_layers >= 4 else 0), num_layers - 1
    return low, (low + high) // 2, high


@dataclass
class Eagle3Config(EagleConfig):
    """Architecture of an EAGLE-3 drafter."""

    draft_vocab_size: int = 0  # 0 = the full target vocabulary
    target_layers: tuple[int, ...] = field(
        default_factory=tuple
    )  # HF hidden_states indices, fused in this order

    def __post_init__(self) -> None:
        super().__post_init__()
        self.target_layers = tuple(int(i) for i in self.target_layers)
        if not self.target_layers:
            raise ValueError(
                "Eagle3Config.target_layers is empty: give the target layers to fuse, e.g. (2,"
                " L//2, L-3)"
            )
        if self.draft_vocab_size == 0:
            self.draft_vocab_size = self.vocab_size
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in 1..{self.vocab_size}, got {self.draft_vocab_size}"
            )

    @classmethod
    def from_hf_config(
        cls, hf_config: Any, draft_vocab_size: int = 0, target_layers: tuple[int, ...] | None = None
    ) -> Eagle3Config:
        """Size the drafter like one layer of the target; default taps ``(2, L//2, L-3)``."""
        layers = target_layers or default_target_layers(int(hf_config.num_hidden_layers))
        return cls(
            **cls.dims_from_hf(hf_config),
            draft_vocab_size=draft_vocab_size,
            target_layers=tuple(layers),
        )


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: q/k/v over concat(norm(embedding), norm(hidden)); residual =
    hidden."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = DraftAttention(config, 2 * h)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = SwiGLU(h, config.intermediate_size)

    def forward(
        self,
        emb: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | TTTPast | None,
    ) -> tuple[torch.Tensor, KVCache | TTTPast]:
        """Drafting (``cache`` a KVCache or None) or one training-time-test step (``cache`` the
        earlier steps' :class:`TTTPast`, ``mask`` step 0's [B|1, 1, N, N] mask): both through
        ``forward``, so FSDP units and activation-checkpoint wrappers see every call."""
        if isinstance(cache, TTTPast):
            return self.ttt_step(emb, hidden, positions, mask, cache)
        x = torch.cat((self.input_layernorm(emb), self.hidden_norm(hidden)), dim=-1)  # [B, S, 2H]
        attn, cache = self.self_attn(x, positions, mask, cache)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), cache

    def ttt_step(
        self,
        emb: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        allowed: torch.Tensor,
        past: TTTPast,
    ) -> tuple[torch.Tensor, TTTPast]:
        """One TTT step over every index at once (emb, hidden [B, N, H], positions [B, N]),
        attending as :func:`ttt_attention` to ``past`` plus its own keys; returns the output and the
        keys with this step's added (a new tuple: a recomputing checkpoint sees the same inputs
        again)."""
        bsz, n, _ = hidden.shape
        x = torch.cat((self.input_layernorm(emb), self.hidden_norm(hidden)), dim=-1)  # [B, N, 2H]
        q, k, v = self.self_attn.project(x, positions)  # [B, nh | nkv, N, d]
        past = TTTPast(past.keys + (k,), past.values + (v,))
        out = ttt_attention(q, list(past.keys), list(past.values), allowed)  # [B, nh, N, d]
        hidden = hidden + self.self_attn.o_proj(out.transpose(1, 2).reshape(bsz, n, -1))
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), past


class Eagle3Drafter(Exportable, nn.Module):
    """EAGLE-3 drafter; the target embedding is a frozen non-persistent buffer, d2t/t2d are exported
    buffers."""

    method = "eagle3"
    config_class = Eagle3Config
    target_weights = ("embed_weight",)
    self_drafting = False  # drafts from its own recurrence over fused target features

    @property
    def tapped_layers(self) -> tuple[int, ...]:
        """Target layers (HF ``hidden_states`` indices) the drafter fuses, in order."""
        return tuple(self.config.target_layers)

    def __init__(
        self,
        config: Eagle3Config,
        embed_weight: torch.Tensor,
        d2t: torch.Tensor | None = None,
        t2d: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        h, n = config.hidden_size, config.draft_vocab_size
        self.fc = nn.Linear(len(config.target_layers) * h, h, bias=False)
        self.layer = Eagle3Layer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, n, bias=False)
        self.register_buffer(
            "embed_weight",
            _frozen(embed_weight, (config.vocab_size, h), "embed_weight"),
            persistent=False,
        )
        if (d2t is None) != (t2d is None):
            raise ValueError("pass both d2t and t2d (drafters/vocab.py builds them) or neither")
        if d2t is None:
            if n != config.vocab_size:
                raise ValueError(
                    f"draft_vocab_size {n} < vocab_size {config.vocab_size} needs d2t/t2d maps: "
                    "build them with draftsmith.drafters.vocab.draft_vocab_from_batches"
                )
            d2t = torch.zeros(n, dtype=torch.long)
            t2d = torch.ones(config.vocab_size, dtype=torch.bool)
        if d2t.shape != (n,) or t2d.shape != (config.vocab_size,) or int(t2d.sum()) != n:
            raise ValueError(
                f"d2t must be [{n}] and t2d [{config.vocab_size}] with {n} True entries; got "
                f"{tuple(d2t.shape)}, {tuple(t2d.shape)} with {int(t2d.sum())}"
            )
        self.register_buffer("d2t", d2t.long().clone())
        self.register_buffer("t2d", t2d.bool().clone())

    def draft_ids_in_target(self) -> torch.Tensor:
        """Target id of every draft id, [N] (ascending when built by drafters/vocab.py)."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids to target ids: ``d + d2t[d]``."""
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def init_lm_head(self, target_lm_head_weight: torch.Tensor) -> None:
        """Start the draft LM head from the target LM head rows of the draft vocabulary."""
        rows = target_lm_head_weight.index_select(
            0, self.draft_ids_in_target().to(target_lm_head_weight.device)
        )
        self.lm_head.weight.copy_(rows)

    def fuse(self, layer_features: torch.Tensor) -> torch.Tensor:
        """concat(target layer features) [B, S, k*H] -> g [B, S, H]."""
        return self.fc(layer_features.to(self.fc.weight.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [..., N] from the layer output ``a`` (pre-norm)."""
        return self.lm_head(self.norm(hidden))

    def logit_parts(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed LM-head input [..., H], draft LM-head weight [N, H]): ``logits`` without the
        matmul, for a fused linear + cross-entropy that never materialises the [..., N] logits."""
        return self.norm(hidden), self.lm_head.weight

    def draft_step(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        """One incremental drafter forward.

        hidden [B, S, H]: ``fuse(target features)`` for pairs from the target, or the drafter's
        previous output ``a`` for draft steps; input_ids [B, S]: the (target-vocab) token after each
        hidden state. Cache and masks work as in ``EagleDrafter.forward``. Returns ``(a [B, S, H],
        logits [B, S, N], cache)``.
        """
        if input_ids.shape != hidden.shape[:2]:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and hidden {tuple(hidden.shape)} must share"
                " [B, S]"
            )
        past = 0 if cache is None else cache.length
        bsz, seq = input_ids.shape
        if positions is None:
            positions = default_positions(bsz, seq, past, input_ids.device)
        mask = build_attention_mask(seq, past, input_ids.device, tree_mask, attention_mask)
        emb = F.embedding(input_ids, self.embed_weight).to(self.fc.weight.dtype)  # [B, S, H]
        out, cache = self.layer(emb, hidden, positions, mask, cache)
        return out, self.logits(out), cache

    def ttt_forward(
        self,
        layer_features: torch.Tensor,
        step_tokens: list[torch.Tensor],
        pair_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Unrolled training-time test over ``len(step_tokens)`` steps; returns ``a_j`` [B, N, H]
        per step.

        layer_features [B, N, k*H] are the target taps of pairs ``0..N-1``; ``step_tokens[j]`` [B,
        N] holds the token input of step ``j`` at each index (``x_{t+1+j}``, zero-padded); pair_mask
        [B, N] (1 = real pair) hides padding keys; ``positions`` [B, N] are the RoPE positions of
        step 0 (default ``0..N-1``; packed rows restart them per document) and ``document_ids`` [B,
        N] (-1 = padding) keep attention inside a document. Gradients flow through ``a`` from one
        step into the next.

        Step ``j``'s query ``t`` attends to the step-0 keys ``s <= t`` of its document and to the
        keys of index ``t`` of steps ``1..j``: the step-0 part is one [N, N] score block built once,
        the later steps add one score per query (:func:`ttt_attention`), never a concatenated [N,
        (j+1)N] mask.
        """
        bsz, n, _ = layer_features.shape
        device = layer_features.device
        base = default_positions(bsz, n, 0, device) if positions is None else positions
        allowed = step0_mask(n, device, pair_mask, document_ids)  # [B|1, 1, N, N] bool, built once
        hidden, past, outputs = self.fuse(layer_features), TTTPast((), ()), []
        for j, tokens in enumerate(step_tokens):
            emb = F.embedding(tokens, self.embed_weight).to(self.fc.weight.dtype)  # [B, N, H]
            hidden, past = self.layer(emb, hidden, base + j, allowed, past)
            outputs.append(hidden)
        return outputs

    def architecture(self) -> dict[str, Any]:
        """Architecture block of the export config."""
        arch = asdict(self.config)
        arch["target_layers"] = list(self.config.target_layers)
        return arch

    @classmethod
    def _build(
        cls, architecture: Eagle3Config, export: ExportContents, embed_weight: torch.Tensor
    ) -> Eagle3Drafter:
        """A drafter on the target's embedding; its d2t/t2d vocabulary maps come from the export."""
        if "d2t" not in export.state or "t2d" not in export.state:
            raise ExportError(
                f"{export.path} lacks the d2t/t2d vocabulary maps; re-export the drafter"
            )
        return cls(architecture, embed_weight, export.state["d2t"], export.state["t2d"])
