"""The learning-rate schedule of every recipe: linear warmup, then constant, linear or cosine decay."""

from __future__ import annotations

import math
from collections.abc import Callable

from draftsmith.common.errors import ConfigError

SCHEDULES = ("constant", "linear", "cosine")


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> Callable[[int], float]:
    """Multiplier of the base LR at a step: linear warmup, then constant / linear / cosine decay to ``min_ratio``."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"optim.scheduler={schedule!r}; valid: {', '.join(SCHEDULES)}")

    def fn(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant" or total_steps <= warmup_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            return 1.0 - (1.0 - min_ratio) * progress
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn
