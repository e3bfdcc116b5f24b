"""Where a speculative step's time goes: drafting, the verify forward, verification, KV compaction,
the proposer's update, and what none of those account for (the loop's own Python)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

PARTS = ("draft", "verify_forward", "verification", "kv_compaction", "proposer_update")


class StepProfiler:
    """Accumulates wall time per part of the speculative steps it is handed
    (``SpeculativeDecoder.profiler``).

    On CUDA every boundary synchronises (otherwise kernel time lands in whichever part syncs next);
    on CPU nothing is added but two ``perf_counter`` calls per part. ``step`` times the whole step
    independently, so ``unattributed_ms`` (the step minus its parts) is the loop overhead no part
    names.
    """

    def __init__(
        self, device: torch.device | str = "cpu", clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.clock = clock  # seconds; injectable so a test's fake clock times the parts too
        self.totals = dict.fromkeys(PARTS, 0.0)  # seconds
        self.step_seconds = 0.0
        self.steps = 0

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return self.clock()

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time one part of the current step."""
        start = self._now()
        try:
            yield
        finally:
            self.totals[name] += self._now() - start

    @contextmanager
    def step(self) -> Iterator[None]:
        """Time one whole step (its parts are timed inside)."""
        start = self._now()
        try:
            yield
        finally:
            self.step_seconds += self._now() - start
            self.steps += 1

    def report(self) -> dict[str, float | int]:
        """Mean ms per step of every part, of the whole step, and the unattributed rest."""
        n = max(1, self.steps)
        parts = {f"{k}_ms": 1e3 * v / n for k, v in self.totals.items()}
        step_ms = 1e3 * self.step_seconds / n
        return {
            "steps": self.steps,
            **parts,
            "step_ms": step_ms,
            "unattributed_ms": step_ms - sum(parts.values()),
        }
