"""Issue 41 item 5: a bench says what it is doing. Each phase prints a line when it starts, lines
while it runs (done of total and an ETA where the phase counts prompts) and one when it ends;
bench.json and the table list the phase times.
"""

from __future__ import annotations

import threading

import pytest

from draftsmith.bench import progress
from draftsmith.bench.timing import time_interleaved

pytestmark = pytest.mark.unit


def test_a_running_phase_prints_lines_with_the_count_and_an_eta():
    lines: list[str] = []
    ticked = threading.Event()

    def log(line: str) -> None:
        lines.append(line)
        if "so far" in line:
            ticked.set()

    bench = progress.start(log=log, every_s=0.01)
    with bench.phase("timing", total=4):
        progress.step(2)  # e.g. time_interleaved after two prompts
        assert "2/4 prompts done, eta " in bench.line()
        assert ticked.wait(30), lines  # the helper thread's line while the phase runs
    assert lines[0] == "[bench] timing (4 prompts)..." and lines[-1].startswith(
        "[bench] timing: done in "
    )
    assert set(bench.times) == {"timing"}
    with bench.phase("calibration"):  # uncounted: the time so far, no count
        assert bench.line().startswith("[bench] calibration: ") and "prompts" not in bench.line()
    assert list(bench.times) == ["timing", "calibration"]
    progress.step()  # no phase running: nothing counted, nothing fails


def test_the_timing_harness_counts_prompts_for_the_running_phase():
    bench = progress.start(log=lambda line: None, every_s=60)
    with bench.phase("timing", total=3):
        time_interleaved({"a": lambda p: [1], "b": lambda p: [2]}, [[1], [2], [3]])
        assert "3/3 prompts done" in bench.line()


def test_the_table_lists_the_phases_and_their_times():
    text = progress.phases_text({"load target, export and prompts": 12.34, "calibration": 75.0})
    assert text == "load target, export and prompts 12.3s; calibration 1m15s (total 1m27s)"
    assert progress.phases_text(None) == "n/a"


def test_a_phase_that_counts_nothing_gets_its_eta_from_the_last_bench_of_the_same_kind(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("DRAFTSMITH_COST_CACHE", str(tmp_path))
    first = progress.start(log=lambda line: None, every_s=60, key="export|T|X")
    with first.phase("calibration (cost-aware draft shape)"):
        assert "eta" not in first.line()  # nothing to go by yet
    first.times["calibration (cost-aware draft shape)"] = 600.0  # as if it had taken ten minutes
    first.remember()
    again = progress.start(log=lambda line: None, every_s=60, key="export|T|X")
    with again.phase("calibration (cost-aware draft shape)"):
        assert ", eta " in again.line() and "(it took 10m00s last time)" in again.line()
    other = progress.start(
        log=lambda line: None, every_s=60, key="export|T|Y"
    )  # another export: no estimate
    with other.phase("calibration (cost-aware draft shape)"):
        assert "eta" not in other.line()
