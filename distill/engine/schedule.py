"""The learning-rate schedule of every recipe: linear warmup, then constant, linear or cosine decay,
or wsd."""

from __future__ import annotations

import math
from collections.abc import Callable

from draftsmith.common.errors import ConfigError

SCHEDULES = ("constant", "linear", "cosine", "wsd")


def lr_lambda(
    schedule: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.1, decay_steps: int = 0
) -> Callable[[int], float]:
    """Multiplier of the base LR at a step: linear warmup, then constant / linear / cosine decay to
    ``min_ratio``, or
    ``wsd`` (warmup-stable-decay): constant, then linear to zero over the last ``decay_steps`` steps
    (the factor is ``(total_steps - step) / decay_steps``: 1 at the decay's first step, 0 at
    ``total_steps``). A cooldown branch of a constant-LR run is a ``wsd`` run resumed from the
    branch point (Hagele et al., arXiv 2405.18392).
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"optim.scheduler={schedule!r}; valid: {', '.join(SCHEDULES)}")
    if schedule == "wsd" and decay_steps < 1:
        raise ConfigError(
            "optim.scheduler=wsd needs optim.decay_steps >= 1 (the steps of its linear decay to"
            " zero)"
        )

    def fn(step: int) -> float:
        if schedule == "wsd" and step >= total_steps - decay_steps:
            return max(0.0, (total_steps - step) / decay_steps)
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule in ("constant", "wsd") or total_steps <= warmup_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            return 1.0 - (1.0 - min_ratio) * progress
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn
