"""What a method asks the target for (:class:`FeatureTaps`) and what it gets back
(:class:`TargetFeatures`); the alignment of every tap is stated in
:mod:`draftsmith.distill.target.frozen`.

An objective that reads the target's logits only through :meth:`TargetFeatures.greedy` and
:meth:`TargetFeatures.logits_at` says so with ``lazy_logits=True``: a feature cache then hands it
the stored greedy ids and the LM head instead of rebuilding the whole [B, T, V] logits every step,
and ``logits_at`` computes only the rows and vocabulary entries asked for (EAGLE-3: the scored
positions x the draft vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class FeatureTaps:
    """What a method asks the target for (see :mod:`draftsmith.distill.target.frozen` for
    alignment)."""

    final_hidden: bool = True
    prenorm_hidden: bool = False
    layers: tuple[int, ...] = ()
    logits: bool = False
    topk: int = 0
    # logits read only through greedy() / logits_at() (see the module docstring)
    lazy_logits: bool = False


@dataclass
class TargetFeatures:
    """Outputs of one no-grad target forward; every tensor is [B, T, ...] and detached."""

    final_hidden: torch.Tensor | None = None  # [B, T, H] post final norm
    prenorm_hidden: torch.Tensor | None = None  # [B, T, H] pre final norm
    layer_hidden: dict[int, torch.Tensor] = field(
        default_factory=dict
    )  # i -> [B, T, H] (HF hidden_states[i])
    logits: torch.Tensor | None = None  # [B, T, V]
    topk_values: torch.Tensor | None = None  # [B, T, k]
    topk_indices: torch.Tensor | None = None  # [B, T, k]
    # [B, T] argmax of the logits, when they are not materialised
    greedy_ids: torch.Tensor | None = None
    # [V, H] LM head: logits = final_hidden @ head_weight.T, rows on demand
    head_weight: torch.Tensor | None = None

    def greedy(self) -> torch.Tensor:
        """The target's greedy next token at every position [B, T] (stored, or the argmax of the
        logits)."""
        if self.greedy_ids is not None:
            return self.greedy_ids
        if self.logits is None:
            raise ValueError(
                "these target features hold neither logits nor greedy ids (taps.logits not asked"
                " for?)"
            )
        return self.logits.argmax(-1)

    def logits_at(
        self, rows: torch.Tensor, cols: torch.Tensor, vocab_ids: torch.Tensor
    ) -> torch.Tensor:
        """The logits of positions ``(rows[m], cols[m])`` restricted to ``vocab_ids``: [M,
        len(vocab_ids)]. From the materialised logits, or only those rows and entries through the LM
        head (the same values: the head is a plain linear layer, which a feature cache checks when
        it is built)."""
        if self.logits is not None:
            return self.logits[rows, cols].index_select(-1, vocab_ids)
        if self.final_hidden is None or self.head_weight is None:
            raise ValueError(
                "these target features hold no logits and no final hidden state + LM head to make"
                " them"
            )
        return F.linear(
            self.final_hidden[rows, cols], self.head_weight.index_select(0, vocab_ids)
        )  # [M, N]

    def draft_logits(self, vocab_ids: torch.Tensor) -> torch.Tensor:
        """The logits of every position restricted to ``vocab_ids`` [Nd]: [B, T, Nd], computed once
        (a teacher over a draft vocabulary: one gather of the materialised logits, or one [H, Nd]
        matmul on the final hidden state; never a [B, T, V] intermediate on the lazy path)."""
        if self.logits is not None:
            return self.logits.index_select(-1, vocab_ids)
        if self.final_hidden is None or self.head_weight is None:
            raise ValueError(
                "these target features hold no logits and no final hidden state + LM head to make"
                " them"
            )
        return F.linear(
            self.final_hidden, self.head_weight.index_select(0, vocab_ids)
        )  # [B, T, Nd]
