"""Is this machine busy while we time? A speed figure taken while other processes ran says little
about the code.

Two readings over the timed interval: the share of every CPU that *other* processes used
(``/proc/stat``'s busy time of all CPUs minus this process's own CPU time), and this process's CPU
time over its wall time. Load average is recorded too, but it is a one-minute moving average that
lags, so the verdict rests on the first reading.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.runtime.decoding.threads import busy_all_seconds
from draftsmith.runtime.serving import Runtime

# other processes using over 10% of all CPUs during timing: the figure is contended
OTHERS_SHARE_LIMIT = 0.10


@dataclass(frozen=True)
class CpuSnapshot:
    """Cumulative CPU counters at one moment."""

    wall_s: float
    own_cpu_s: float
    busy_all_s: float | None  # busy seconds of all CPUs (None where /proc/stat is unreadable)


def snapshot() -> CpuSnapshot:
    """The counters now."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return CpuSnapshot(time.perf_counter(), usage.ru_utime + usage.ru_stime, busy_all_seconds())


def verdict(
    start: CpuSnapshot, end: CpuSnapshot, cpus: int | None = None, limit: float = OTHERS_SHARE_LIMIT
) -> dict[str, Any]:
    """What the interval from ``start`` to ``end`` says: others' share of all CPUs, this process's
    CPU over wall, the load average, and ``contended`` with the reason."""
    cpus = cpus or os.cpu_count() or 1
    wall = max(end.wall_s - start.wall_s, 1e-9)
    own = end.own_cpu_s - start.own_cpu_s
    others = None
    if start.busy_all_s is not None and end.busy_all_s is not None:
        others = max(0.0, (end.busy_all_s - start.busy_all_s) - own) / (wall * cpus)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    contended = others is not None and others > limit
    why = (
        f"other processes used {others:.0%} of the {cpus} CPUs while timing (over {limit:.0%}): the"
        " figures are contended; rerun on a quiet machine"
        if contended
        else None
    )
    return {
        "others_cpu_share": None if others is None else round(others, 3),
        "own_cpu_over_wall": round(own / wall, 2),
        "load_average_1m": None if load is None else round(load, 2),
        "cpus": cpus,
        "contended": contended,
        "why": why,
    }


def calibrated_if_quiet(
    runtime: Runtime, calibrate: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """Run the bench's cost-aware ``calibrate()`` (it returns its record, ``cache`` the decision
    file it wrote). When other processes were busy meanwhile, its measured costs are not this
    machine's: the decision it cached is taken back (the one cached there before, if any, is put
    back) while this bench still serves it. The record gets ``cached``, ``calibration_contention``
    and, when not cached, ``not_cached_why``."""
    from draftsmith.common.atomic_folder import write_file
    from draftsmith.runtime.shapes import shape_cache

    path = (
        Path(shape_cache.cache_dir())
        / f"{shape_cache.cache_key(shape_cache.machine_identity(runtime))}.json"
    )
    before = path.read_bytes() if path.is_file() else None
    start = snapshot()
    record = calibrate()
    busy = verdict(start, snapshot())
    record = {**record, "calibration_contention": busy, "cached": not busy["contended"]}
    if busy["contended"]:
        written = Path(record["cache"]) if record.get("cache") else path
        if written == path and before is not None:
            write_file(written, before)
        else:
            written.unlink(missing_ok=True)
        record["not_cached_why"] = (
            f"{busy['why']}: the calibration's costs are not cached as this machine's "
            f"({'the earlier calibration stays' if before else 'nothing cached'}); this bench "
            "still serves its choice"
        )
    return record


def verdict_text(busy: dict[str, Any]) -> str:
    """The report's line on the machine while timing: CONTENDED with the reason, or quiet, with the
    readings behind the verdict."""
    share = busy.get("others_cpu_share")
    readings = (
        f"others used {'n/a' if share is None else f'{share:.0%}'} of {busy['cpus']} CPUs; own"
        f" CPU/wall {busy['own_cpu_over_wall']:.2f}; load {busy.get('load_average_1m')}"
    )
    return (
        f"**CONTENDED**: {busy['why']} ({readings})"
        if busy.get("contended")
        else f"quiet ({readings})"
    )
