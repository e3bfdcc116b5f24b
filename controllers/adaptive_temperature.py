"""Adaptive-temperature layer (LPO, arXiv 2411.09661): a small head on the frozen target's post-norm
hidden state that picks a sampling temperature from a discrete grid, per response (``sequence``) or
per generated token (``token``).

Layout: ``LayerNorm(H)`` (the target's post-norm hidden has a model-specific scale), ``num_layers``
independent ``Linear + SiLU`` blocks (built with a comprehension: each has its own weights), then
``Linear(width, K)`` over the K grid temperatures. The output layer starts at zero, so an untrained
head is the uniform policy over the grid: the first round of rollouts samples uniformly random
temperatures, as the paper's first round does.

Granularity:
- ``sequence`` (AD_seq): one temperature from the hidden state of the prompt's last token, kept for
  the whole response.
- ``token`` (AD_tok): at every step the hidden state that produces the next token's logits picks
  that token's temperature. Temperature 0 is greedy decoding (the argmax), as in the runtime's
  ``target_probs``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.export.exportable import Exportable

METHOD = "adaptive_temperature"
DEFAULT_GRID = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
GRANULARITIES = ("sequence", "token")
CHOICES = ("greedy", "sample")


def check_grid(grid: Sequence[float]) -> tuple[float, ...]:
    """The temperature grid as a sorted tuple; ValueError for an empty grid or a negative,
    non-finite or repeated temperature (each is a user mistake in ``controller.grid``)."""
    try:
        values = tuple(float(t) for t in grid)
    except (TypeError, ValueError):
        raise ValueError(f"the temperature grid must be a list of numbers, got {grid!r}") from None
    if not values:
        raise ValueError(
            "the temperature grid is empty; give at least one temperature, e.g. [0.0, 0.2, ...,"
            " 1.0]"
        )
    bad = [t for t in values if not math.isfinite(t) or t < 0]
    if bad:
        raise ValueError(
            f"temperatures must be finite and >= 0 (0 = greedy), got {bad} in the grid"
            f" {list(values)}"
        )
    if len(set(values)) != len(values):
        raise ValueError(f"the temperature grid repeats a value: {list(values)}")
    return tuple(sorted(values))


def check_granularity(granularity: str) -> str:
    """``granularity`` if it is ``sequence`` or ``token``, else ValueError naming both."""
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}"
        )
    return granularity


@dataclass
class AdaptiveTemperatureConfig:
    """Architecture of the head: the target's hidden size, the grid, the granularity and the MLP's
    size."""

    hidden_size: int
    grid: list[float] = field(default_factory=lambda: list(DEFAULT_GRID))
    granularity: str = "token"
    width: int = 128
    # Linear + SiLU blocks before the output layer (0 = a linear head on the normed hidden)
    num_layers: int = 1

    def __post_init__(self) -> None:
        self.grid = list(check_grid(self.grid))
        check_granularity(self.granularity)
        if self.hidden_size < 1 or self.width < 1 or self.num_layers < 0:
            raise ValueError(
                f"need hidden_size >= 1, width >= 1 and num_layers >= 0, got {self.hidden_size}, "
                f"{self.width}, {self.num_layers}"
            )


class AdaptiveTemperatureHead(Exportable, nn.Module):
    """Target hidden [..., H] -> logits over the temperature grid [..., K]."""

    method = METHOD
    config_class = AdaptiveTemperatureConfig
    extra_architecture_keys = True

    def __init__(self, config: AdaptiveTemperatureConfig) -> None:
        super().__init__()
        self.config = config
        self.norm = nn.LayerNorm(config.hidden_size)
        sizes = [config.hidden_size] + [config.width] * config.num_layers
        # One block per layer, each with its own weights (never ``[block] * n``).
        self.blocks = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(sizes[i], sizes[i + 1]), nn.SiLU())
                for i in range(config.num_layers)
            ]
        )
        self.out = nn.Linear(sizes[-1], len(config.grid))
        nn.init.zeros_(self.out.weight)  # uniform policy before training
        nn.init.zeros_(self.out.bias)
        self.register_buffer(
            "grid", torch.tensor(config.grid, dtype=torch.float32), persistent=False
        )  # [K]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.norm(hidden.to(self.out.weight.dtype))
        return self.out(self.blocks(x))  # [..., H] -> [..., K]

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """log P(temperature index | hidden) [..., K]."""
        return F.log_softmax(self(hidden).float(), dim=-1)

    def choose(
        self, hidden: torch.Tensor, mode: str = "greedy", generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Temperature indices [...]: the head's argmax (``greedy``) or a draw from it
        (``sample``)."""
        if mode not in CHOICES:
            raise ValueError(f"choice mode must be one of {', '.join(CHOICES)}, got {mode!r}")
        # the argmax of the logits is that of their log-softmax: skip the normalisation
        if mode == "greedy":
            return self(hidden).argmax(-1)
        logp = self.log_probs(hidden)  # [..., K]
        flat = logp.reshape(-1, logp.shape[-1]).exp()  # [N, K]
        if generator is not None and generator.device != flat.device:
            flat = flat.to(generator.device)
        return (
            torch.multinomial(flat, 1, generator=generator).reshape(logp.shape[:-1]).to(logp.device)
        )

    def temperatures(self, indices: torch.Tensor) -> torch.Tensor:
        """Grid temperatures [...] of ``indices`` [...]."""
        return self.grid.to(indices.device)[indices]


class TemperaturePolicy:
    """The runtime's ``temperature_policy``: target hidden rows [T, H] -> temperatures [T] (0 =
    greedy).

    ``mode="greedy"`` (the default for serving) takes the head's most likely temperature:
    deterministic given the context, and the paper finds no significant difference to sampling it
    (Table 5). ``mode="sample"`` draws the index from the head (what rollouts need: LPO learns from
    the decoder's own random choices). Token granularity answers every row. Sequence granularity
    decides once, from the last row of the first call after :meth:`reset` (the speculative loop's
    first call is the prompt's last hidden state), and repeats that temperature for the rest of the
    response; call :meth:`reset` before each new prompt. ``last_indices`` holds the indices of the
    latest call. A sequence-level answer is a read-only view of the cached choice (expanded, not
    copied: the loop only reads it).
    """

    def __init__(
        self,
        head: AdaptiveTemperatureHead,
        mode: str = "greedy",
        generator: torch.Generator | None = None,
        granularity: str | None = None,
    ) -> None:
        if mode not in CHOICES:
            raise ValueError(f"choice mode must be one of {', '.join(CHOICES)}, got {mode!r}")
        self.head, self.mode, self.generator = head, mode, generator
        self.granularity = check_granularity(granularity or head.config.granularity)
        self.last_indices: torch.Tensor | None = None
        self._sequence_index: torch.Tensor | None = None
        self._sequence_temperature: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget the sequence-level choice (call before each new prompt)."""
        self._sequence_index = self._sequence_temperature = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.numel() // hidden.shape[-1]  # T
        flat = hidden.reshape(rows, hidden.shape[-1])  # [T, H] (the head casts to its own dtype)
        if self.granularity == "token":
            with torch.no_grad():
                self.last_indices = self.head.choose(flat, self.mode, self.generator)  # [T]
            return self.head.temperatures(self.last_indices)
        # a response's first call decides; later calls only repeat it (no head)
        if self._sequence_index is None:
            with torch.no_grad():
                self._sequence_index = self.head.choose(flat[-1:], self.mode, self.generator)[0]
            self._sequence_temperature = self.head.temperatures(self._sequence_index)
        self.last_indices = self._sequence_index.expand(rows)  # [T]
        return self._sequence_temperature.expand(rows)  # [T]
        with torch.no_grad():
            flat = hidden.reshape(
                rows, hidden.shape[-1]
            )  # [T, H] (the head casts to its own dtype)
            if self.granularity == "token":
                idx = self.head.choose(flat, self.mode, self.generator)  # [T]
                self.last_indices = idx
                return self.head.temperatures(idx)
            self._sequence_index = self.head.choose(flat[-1:], self.mode, self.generator)[0]
            self._sequence_temperature = self.head.temperatures(self._sequence_index)
            self.last_indices = self._sequence_index.expand(rows)  # [T]
            return self._sequence_temperature.expand(rows)  # [T]
