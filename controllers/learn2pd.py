"""Learn2PD's filter: a small MLP from the block's ``L`` confidences to ``L`` "already final"
logits.

The filter sees only the confidences ``softmax(logits)[argmax]`` of the block's slots, in order (no
tokens, no positions beyond that order), so it is tied to the block length, and to the steps and
threshold of the decoding that produced its training trajectories: all three are exported with it
and a different block length at load is an error. A slot is committed early when
``sigmoid(filter(conf)) > threshold``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from draftsmith.common.errors import DraftsmithError
from draftsmith.export.exportable import Exportable, ExportContents

METHOD = "learn2pd"


class FilterMismatchError(DraftsmithError, ValueError):
    """A filter is used with a decoding setup it was not trained for (block length)."""


@dataclass
class Learn2PDConfig:
    """The filter's shape and the decoding it was trained for."""

    block_length: int = 32
    hidden: int = 32
    # 1 = logistic regression per slot-vector (the paper: similar accuracy, more conservative)
    num_layers: int = 2
    threshold: float = 0.9
    steps_per_block: int = 32


class Learn2PDFilter(Exportable, nn.Module):
    """``conf [..., L] -> logits [..., L]``; independent layers (built by comprehension, never
    shared)."""

    method = METHOD
    config_class = Learn2PDConfig

    def __init__(self, config: Learn2PDConfig) -> None:
        super().__init__()
        self.config = config
        widths = (
            [config.block_length]
            + [config.hidden] * (config.num_layers - 1)
            + [config.block_length]
        )
        self.layers = nn.ModuleList([nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:])])
        self.act = nn.ReLU()

    def forward(self, conf: torch.Tensor) -> torch.Tensor:
        """Logits [..., L] for confidences [..., L]."""
        if conf.shape[-1] != self.config.block_length:
            raise FilterMismatchError(
                f"the filter was trained for blocks of {self.config.block_length} slots but got "
                f"{conf.shape[-1]} confidences; retrain it for this block length"
            )
        x = conf
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = self.act(x)
        return x

    @torch.no_grad()
    def accept(self, conf: torch.Tensor, threshold: float | None = None) -> torch.Tensor:
        """Bool [..., L]: the slots whose predicted probability of being final exceeds
        ``threshold``."""
        thr = self.config.threshold if threshold is None else threshold
        return torch.sigmoid(self(conf.to(self.layers[0].weight.dtype))) > thr

    @classmethod
    def _build(
        cls, architecture: Learn2PDConfig, export: ExportContents, block_length: int | None = None
    ) -> Learn2PDFilter:
        """The filter of an export; ``block_length`` (the target's) must match the one it was
        trained for."""
        if block_length is not None and int(block_length) != architecture.block_length:
            raise FilterMismatchError(
                f"{export.path} was trained for block length {architecture.block_length} but the"
                f" target decodes blocks of {block_length}; retrain the filter on trajectories of"
                " this target (draftsmith trajectories)"
            )
        return cls(architecture)
