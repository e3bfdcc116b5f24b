"""What the bench is doing, said while it does it: a line when a phase starts, one at least every
:data:`EVERY_S` seconds while it runs (prompts done of the total and an ETA where the phase counts
them; for a phase that counts nothing, loading or calibration, the ETA is the time it took in the
last bench of the same kind), one when it ends; the phase times go into bench.json (``phases``) and
the table.

One :class:`Progress` per bench (:func:`start` makes it, :func:`current` finds it); the timers in
:mod:`draftsmith.bench.timing` call :func:`step` after each prompt, which counts for whatever phase
is open (none
open: nothing happens), so the harness needs no progress argument threaded through every call.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from draftsmith.common.durations import eta_seconds, format_duration

# seconds between progress lines of a running phase (the target is one at least every 15 s)
EVERY_S = 10.0
T = TypeVar("T")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class Progress:
    """Phase lines and times of one bench (see the module docstring). ``log`` gets each line."""

    log: Callable[[str], None] = _stderr
    every_s: float = EVERY_S
    times: dict[str, float] = field(default_factory=dict)
    expected: dict[str, float] = field(
        default_factory=dict
    )  # each phase's time in the last bench of the same kind
    key: str | None = None  # what "the same kind" is (:func:`start`)
    _name: str | None = None
    _total: int | None = None
    _done: int = 0
    _start: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def line(self) -> str:
        """The running phase's line: its name, the time spent, and (when counted) done of total with
        the ETA."""
        with self._lock:
            spent = time.perf_counter() - self._start
            text = f"[bench] {self._name}: {format_duration(spent)} so far"
            if self._total:
                left = eta_seconds(self._done, self._total, spent)
                text += (
                    f", {self._done}/{self._total} prompts done, eta "
                    f"{format_duration(left) if left is not None else 'after the first prompt'}"
                )
            # uncounted (loading, calibration): the last bench's time says
            elif self._name in self.expected:
                before = self.expected[self._name]
                text += (
                    f", eta {format_duration(before - spent)} (it took {format_duration(before)}"
                    " last time)"
                    if before > spent
                    else f", longer than last time ({format_duration(before)})"
                )
            return text

    def remember(self) -> None:
        """Keep this bench's phase times as the next one's estimates (beside the measured costs, per
        ``key``)."""
        if self.key is None:
            return
        import json

        from draftsmith.common.atomic_folder import write_file

        path = history_file()
        try:
            history = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            history = {}  # a damaged history only costs the estimates
        history[self.key] = self.times
        write_file(path, json.dumps(history, indent=1) + "\n")

    @contextmanager
    def phase(self, name: str, total: int | None = None) -> Iterator[None]:
        """Run a phase: its start line, a line every ``every_s`` from a helper thread while it runs,
        its end line."""
        with self._lock:
            self._name, self._total, self._done, self._start = name, total, 0, time.perf_counter()
        counted = f" ({total} prompts)" if total else ""
        self.log(f"[bench] {name}{counted}...")
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(self.every_s):
                self.log(self.line())

        ticker = threading.Thread(target=tick, name="bench-progress", daemon=True)
        ticker.start()
        ended = "done"
        try:
            yield
        except BaseException:
            ended = "stopped"  # an error or Ctrl-C: its own line follows
            raise
        finally:
            stop.set()
            ticker.join()
            spent = time.perf_counter() - self._start
            self.times[name] = round(self.times.get(name, 0.0) + spent, 2)
            self.log(
                f"[bench] {name}: {ended} after {format_duration(spent)}"
                if ended != "done"
                else f"[bench] {name}: done in {format_duration(spent)}"
            )
            with self._lock:
                self._name, self._total = None, None

    def run(self, name: str, work: Callable[[], T], total: int | None = None) -> T:
        """``work()`` as the phase ``name`` (:meth:`phase`); returns what it returns."""
        with self.phase(name, total):
            return work()

    def step(self, count: int = 1) -> None:
        """``count`` more prompts of the running phase done (nothing when no phase is running)."""
        with self._lock:
            if self._name is not None:
                self._done += count


_CURRENT = Progress()


def history_file() -> Path:
    """Where phase times are kept for the next bench's ETAs: beside the measured costs
    (``DRAFTSMITH_COST_CACHE``)."""
    from draftsmith.runtime.shapes.shape_cache import cache_dir

    return Path(cache_dir()) / "bench_phases.json"


def start(
    log: Callable[[str], None] = _stderr, every_s: float = EVERY_S, key: str | None = None
) -> Progress:
    """A fresh :class:`Progress` for a new bench, made current; with ``key`` (the bench's kind:
    mode, target, export) the phases that count nothing get an ETA from the last bench of that key
    (:meth:`Progress.remember`).
    """
    import json

    global _CURRENT
    expected: dict[str, float] = {}
    if key is not None and history_file().is_file():
        try:
            expected = dict(json.loads(history_file().read_text()).get(key) or {})
        except (OSError, ValueError, AttributeError):
            expected = {}
    _CURRENT = Progress(log=log, every_s=every_s, expected=expected, key=key)
    return _CURRENT


def current() -> Progress:
    """The bench's :class:`Progress` (one exists from import on, so library calls of the bench
    report too)."""
    return _CURRENT


def step(count: int = 1) -> None:
    """Count ``count`` prompts for the running phase of the current bench."""
    _CURRENT.step(count)


def phases_text(times: dict[str, Any] | None) -> str:
    """The table's cell: each phase and its time, in the order they ran, and the total."""
    if not times:
        return "n/a"

    def short(seconds: float) -> str:
        return f"{seconds:.1f}s" if seconds < 60 else format_duration(seconds)

    total = sum(times.values())
    return "; ".join(f"{name} {short(s)}" for name, s in times.items()) + f" (total {short(total)})"


__all__ = ["EVERY_S", "Progress", "current", "phases_text", "start", "step"]
