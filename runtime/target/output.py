"""The one result type of a target forward, shared by the lean decoder and the HF fallback."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TargetOutput:
    """What a target forward over T new tokens returns.

    ``logits`` [T', V]: rows chosen by ``logits_for`` ("all": T' = T, "last": 1, or the given row
    indices); None when the forward was asked for ``head="argmax"``, which returns ``argmax`` [T']
    (long) instead. ``hidden`` [T, H]: post-final-norm hidden states (row i produced logits row i
    when ``logits_for="all"``).
    ``taps``: residual-stream taps requested with ``taps=(...)``: layer i -> the input of decoder
    layer i [T, H] (0 = the embeddings, ``num_layers`` = the last layer's output before the final
    norm).
    """

    logits: torch.Tensor | None
    hidden: torch.Tensor
    taps: dict[int, torch.Tensor] = field(default_factory=dict)
    argmax: torch.Tensor | None = (
        None  # [T'] the first maximum of each logits row, for head="argmax"
    )

    def tap_features(
        self, layers: Sequence[int], rows: slice | torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The taps of ``layers`` concatenated in that order, [T, len(layers)*H], or only at
        ``rows`` (a slice or an index tensor: the accepted nodes; picked before the concatenation,
        so only those rows are copied); None when ``layers`` is empty."""
        if not layers:
            return None
        missing = [i for i in layers if i not in self.taps]
        if missing:
            raise ValueError(
                f"the target forward returned no taps for layers {missing} "
                f"(it returned {sorted(self.taps)}); "
                "its forward must honour taps=(...) (the lean decoder and the HF fallback do)"
            )
        if rows is None:
            return torch.cat([self.taps[i] for i in layers], dim=-1)  # [T, k*H]
        pick = (lambda t: t[rows]) if isinstance(rows, slice) else (lambda t: t[rows.to(t.device)])
        return torch.cat([pick(self.taps[i]) for i in layers], dim=-1)  # [rows, k*H]
