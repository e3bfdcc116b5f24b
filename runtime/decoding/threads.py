"""Threads that survive a busy machine: fewer threads while other processes hold CPUs, all of them
when it is quiet.

Torch's OpenMP threads spin at every barrier. When another process holds one of the cores, one of
our threads waits for a time slice while the other spins for it, at every parallel region of every
layer: on a 2-core AMD EPYC (Zen 4) plain decoding of the embedded target fell from 90.6 to 1.5
tokens/s beside one busy process, where one thread ran at 60.5 (quiet: 64.6). Spinning less
(``OMP_WAIT_POLICY=PASSIVE``) held 53.8 busy but cost 30% on a quiet machine.

So the decode loops call :meth:`ThreadGovernor.tick` once a step. About every ``interval_s`` it
reads how much CPU other processes used since the last look (``/proc/stat``'s busy time of all CPUs
minus this process's CPU time) and sets torch's thread count to the cores they leave free (at least
one, at most the count it started with). Between looks a tick costs one clock read. Where
``/proc/stat`` cannot be read, or ``DRAFTSMITH_THREADS=fixed``, it does nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

# a core counts as taken when other processes used over a quarter of it since the last look
OTHERS_BUSY = 0.25


def busy_all_seconds(stat: str | Path = "/proc/stat") -> float | None:
    """Busy seconds of all CPUs since boot (user+nice+system+irq+softirq+steal; idle and iowait left
    out), None where unreadable. The bench's contention verdict reads the same counter."""
    try:
        with open(stat) as handle:
            fields = [int(x) for x in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    """Adapts torch's intra-op thread count to the cores other processes leave free (see the module
    docstring)."""

    def __init__(
        self,
        interval_s: float = 0.1,
        cpus: int | None = None,
        busy_reader: Callable[[], float | None] = busy_all_seconds,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        get_threads: Callable[[], int] = torch.get_num_threads,
        clock: Callable[[], float] = time.perf_counter,
        own_cpu: Callable[[], float] = time.process_time,
    ) -> None:
        self.interval_s, self.cpus = interval_s, cpus or os.cpu_count() or 1
        self._busy, self._set, self._get, self._clock, self._own = (
            busy_reader,
            set_threads,
            get_threads,
            clock,
            own_cpu,
        )
        self.enabled = (
            os.environ.get("DRAFTSMITH_THREADS", "auto") != "fixed" and busy_reader() is not None
        )
        self.max_threads = get_threads()
        self.changes = 0  # how often the thread count changed (bench records it)
        self._last = None if not self.enabled else (clock(), own_cpu(), busy_reader())

    def tick(self) -> None:
        """Call once per decode step; looks at the machine about every ``interval_s``."""
        if self._last is None:
            return
        now = self._clock()
        if now - self._last[0] < self.interval_s:
            return
        own, busy = self._own(), self._busy()
        wall, own_used, busy_used = (
            now - self._last[0],
            own - self._last[1],
            (busy or 0.0) - (self._last[2] or 0.0),
        )
        self._last = (now, own, busy)
        taken = max(0.0, busy_used - own_used) / wall  # cores' worth of CPU other processes used
        cores_taken = int(taken + 1 - OTHERS_BUSY)  # 0.25 of a core or more counts as a whole core
        want = max(1, min(self.max_threads, self.cpus - cores_taken))
        if want != self._get():
            self._set(want)
            self.changes += 1

    def restore(self) -> None:
        """Give back the thread count it started with."""
        if self.enabled and self._get() != self.max_threads:
            self._set(self.max_threads)


_GOVERNOR: ThreadGovernor | None = None


def governor() -> ThreadGovernor:
    """The process's one governor (made on first use, after the user's own
    ``torch.set_num_threads``)."""
    global _GOVERNOR
    if _GOVERNOR is None:
        _GOVERNOR = ThreadGovernor()
    return _GOVERNOR
