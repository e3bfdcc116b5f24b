"""Issue 41 item 6: the bench's own timings (forward curve, plain-step curve) run under the thread
governor the decode loops use, and a cost-aware calibration measured while other processes were busy
is not cached as this machine's.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from draftsmith.bench import contention, step_costs
from draftsmith.runtime.serving import load_runtime
from draftsmith.runtime.shapes import shape_cache, target_timing

pytestmark = pytest.mark.unit


class CountingGovernor:
    """A governor that counts ticks (the real one adapts threads; here only whether it is asked
    matters)."""

    max_threads, changes = 1, 0

    def __init__(self) -> None:
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1


def test_the_bench_forward_curve_and_the_calibration_curves_tick_the_governor(
    medusa_export, monkeypatch
):
    rt = load_runtime(str(medusa_export), None, "fp32")
    gov = CountingGovernor()
    monkeypatch.setattr(step_costs, "governor", lambda: gov)
    monkeypatch.setattr(target_timing, "governor", lambda: gov)
    prompt = list(range(5, 25))
    step_costs.step_costs(rt, prompt, repeats=2)
    forwards = 2 * len(step_costs.FORWARD_SIZES)  # every timed forward of the curve (warm-up aside)
    assert gov.ticks >= forwards, gov.ticks
    before = gov.ticks
    target_timing.forward_curve(rt.model, prompt, sizes=(1, 2, 3), repeats=2)
    target_timing.decode_step_ms(rt.model, [prompt], 4)
    assert gov.ticks - before >= 3 * 2 + 4


def _runtime(tmp_path: Path):
    model = SimpleNamespace(dtype=torch.float32, linear_ops="dense")
    return SimpleNamespace(
        folder=str(tmp_path / "target"),
        model=model,
        export_config={"method": "medusa", "fingerprint": "abc"},
    )


@pytest.mark.parametrize("earlier", [None, b'{"shape": "quiet one"}'])
def test_a_calibration_measured_while_contended_is_not_cached(tmp_path, monkeypatch, earlier):
    monkeypatch.setenv("DRAFTSMITH_COST_CACHE", str(tmp_path / "costs"))
    runtime = _runtime(tmp_path)
    path = (
        Path(shape_cache.cache_dir())
        / f"{shape_cache.cache_key(shape_cache.machine_identity(runtime))}.json"
    )
    path.parent.mkdir(parents=True)
    if earlier is not None:
        path.write_bytes(earlier)

    def calibrate():  # what choose_cost_aware_shape does: decide, cache, return the record
        path.write_text(json.dumps({"shape": "measured while busy"}))
        return {"summary": "tree", "cache": str(path)}

    busy = {
        "contended": True,
        "why": "other processes used 60% of the 2 CPUs while timing (over 10%)",
    }
    monkeypatch.setattr(contention, "verdict", lambda start, end: busy)
    record = contention.calibrated_if_quiet(runtime, calibrate)
    assert record["cached"] is False and record["summary"] == "tree"  # still served by this bench
    assert record["not_cached_why"].startswith("other processes used 60%")
    assert (path.read_bytes() == earlier) if earlier is not None else not path.exists()

    monkeypatch.setattr(contention, "verdict", lambda start, end: {"contended": False, "why": None})
    record = contention.calibrated_if_quiet(runtime, calibrate)
    assert record["cached"] is True and json.loads(path.read_text()) == {
        "shape": "measured while busy"
    }


def test_the_table_says_when_the_calibration_was_not_cached():
    from draftsmith.bench.report import _cost_model_rows

    rows = dict(
        _cost_model_rows(
            {"summary": "tree:6", "cached": False, "not_cached_why": "contended: not cached"}
        )
    )
    assert rows["calibration NOT CACHED"] == "contended: not cached"
    assert "calibration NOT CACHED" not in dict(
        _cost_model_rows({"summary": "tree:6", "cached": True})
    )
