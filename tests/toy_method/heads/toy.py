"""The toy method's nn.Module: one linear head on the target's post-norm hidden state at t that
predicts token t+2 (the target's own head predicts t+1), i.e. a one-head Medusa without the residual
block."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ToyHead(nn.Module):
    """hidden [..., H] -> logits [..., V] of the token two positions ahead."""

    def __init__(self, hidden_size: int, vocab_size: int, bias: bool) -> None:
        super().__init__()
        self.hidden_size, self.vocab_size, self.bias = hidden_size, vocab_size, bias
        self.proj = nn.Linear(hidden_size, vocab_size, bias=bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the token after next."""
        return self.proj(hidden)

    def architecture(self) -> dict[str, Any]:
        """The export's ``architecture`` block: what the proposer needs to rebuild the module."""
        return {"hidden_size": self.hidden_size, "vocab_size": self.vocab_size, "bias": self.bias}
