"""The bench says when its figures were taken on a busy machine."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from draftsmith.bench import contention

pytestmark = pytest.mark.unit


def test_a_busy_neighbour_is_reported_and_a_quiet_interval_is_not():
    start = contention.snapshot()
    time.sleep(0.3)
    quiet = contention.verdict(
        start, contention.snapshot(), limit=0.9
    )  # no fixed share: CI machines vary
    assert quiet["own_cpu_over_wall"] < 0.5  # sleeping uses no CPU of its own
    neighbour = subprocess.Popen(
        [sys.executable, "-c", "import time\nend=time.time()+2\nwhile time.time()<end: pass"]
    )
    try:
        time.sleep(0.3)  # let it start
        start = contention.snapshot()
        time.sleep(1.0)
        busy = contention.verdict(start, contention.snapshot(), cpus=2)
    finally:
        neighbour.kill()
    # one spinning process of 2 CPUs
    assert busy["others_cpu_share"] is not None and busy["others_cpu_share"] >= 0.3
    assert busy["contended"] and "rerun on a quiet machine" in busy["why"]
    assert "CONTENDED" in contention.verdict_text(busy)


def test_own_work_is_not_counted_as_contention():
    start = contention.CpuSnapshot(wall_s=0.0, own_cpu_s=0.0, busy_all_s=100.0)
    alone = contention.verdict(
        start, contention.CpuSnapshot(1.0, 1.9, 101.9), cpus=2
    )  # both cores were ours
    assert (
        alone["others_cpu_share"] == 0.0
        and not alone["contended"]
        and alone["own_cpu_over_wall"] == 1.9
    )
    shared = contention.verdict(
        start, contention.CpuSnapshot(1.0, 1.0, 102.0), cpus=2
    )  # one core was someone else's
    assert shared["others_cpu_share"] == 0.5 and shared["contended"]


def test_without_proc_stat_the_verdict_is_not_contended_and_says_so(tmp_path):
    assert contention.busy_all_seconds(tmp_path / "missing") is None
    start = contention.CpuSnapshot(0.0, 0.0, None)
    verdict = contention.verdict(start, contention.CpuSnapshot(1.0, 0.5, None), cpus=2)
    assert verdict["others_cpu_share"] is None and verdict["contended"] is False
    assert "n/a" in contention.verdict_text(verdict)
