"""Choosing from learning curves: CPU-hours from measured training segments, the best point of a
run by held-out acceptance, two curves compared at equal CPU-hours (and at equal tokens) with the
noise of the pick, and `make train-best` training the picked recipe."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
from curve_fakes import FakeTraining, fake_evaluate

from draftsmith.evals.curve_compare import compare
from draftsmith.evals.curve_pick import CURVE_DEFAULTS, interpolate
from draftsmith.evals.curve_report import best_point, settle_cpu_hours
from draftsmith.evals.curve_runner import run_curve
from draftsmith.evals.curve_training import DEFAULT_OVERRIDES
from draftsmith.evals.learning_curve import EvalSettings

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]


def test_cpu_hours_come_from_measured_segments_and_estimate_the_unmeasured_ones():
    points = [
        {
            "steps": 10,
            "tokens": 1000,
            "cpu_hours": 9.0,
        },  # wall-clock only (contended, written before)
        {
            "steps": 20,
            "tokens": 3000,
            "train_cpu_seconds_total": 200.0,
        },  # its segment alone: 2000 tokens
        {"steps": 40, "tokens": 7000, "train_cpu_seconds_total": 600.0},
    ]  # + 400 s for 4000 tokens
    settled = settle_cpu_hours(points)
    assert [p["cpu_hours_estimated"] for p in settled] == [True, False, False]
    assert [round(p["cpu_hours"] * 3600) for p in settled] == [
        100,
        300,
        700,
    ]  # 0.1 s a token for the first


def test_the_best_point_is_chosen_by_held_out_acceptance_and_says_when_the_run_went_past_it():
    def point(steps: int, mt: float, he: float) -> dict:
        return {
            "steps": steps,
            "tokens": steps * 1000,
            "eval": {
                "mtbench": {"first_position_acceptance": mt},
                "humaneval": {"first_position_acceptance": he},
            },
        }

    data = {
        "settings": {"prompt_sets": ["mtbench", "humaneval"]},
        "points": [point(10, 0.2, 0.1), point(100, 0.5, 0.3), point(1000, 0.45, 0.25)],
    }
    best = best_point(data)  # means 0.15, 0.40, 0.35: the run trained past its best point
    assert best["steps"] == 100 and best["export"] == "points/step100/export"
    assert best["mean_first_position"] == pytest.approx(0.4) and best[
        "last_below_by"
    ] == pytest.approx(0.05)
    data["points"].append(
        point(3000, 0.3, 0.5)
    )  # a tie keeps the earlier, cheaper point; the last is that far below
    assert best_point(data)["steps"] == 100 and best_point(data)["last_below_by"] == pytest.approx(
        0.0
    )
    assert best_point({**data, "points": []}) is None


def test_the_curve_defaults_are_its_overrides_and_interpolation_never_extrapolates():
    assert set(CURVE_DEFAULTS) == {f"{k}={v}" for k, v in DEFAULT_OVERRIDES.items()}
    assert interpolate([1, 100], [0.2, 0.6], 10) == pytest.approx(0.4)  # halfway on a log axis
    assert interpolate([1, 100], [0.2, 0.6], 200) is None  # never extrapolated


def _bill(curve: Path, cpu_seconds_a_token: float) -> None:
    """Give every point of ``curve`` the training CPU time of ``cpu_seconds_a_token``."""
    data = json.loads((curve / "curve.json").read_text())
    for p in data["points"]:
        p["train_cpu_seconds_total"] = p["tokens"] * cpu_seconds_a_token
    (curve / "curve.json").write_text(json.dumps(data))


def _compared(tmp_path: Path) -> Path:
    """Two curves, the second reaching each acceptance at a tenth of the first's CPU time,
    compared; the comparison's folder."""
    settings = EvalSettings(prompt_sets=("mtbench",))
    slow, fast = tmp_path / "slow", tmp_path / "fast"
    run_curve(
        slow,
        ["recipe=eagle3"],
        [10, 100],
        settings,
        runner=FakeTraining(checkpoints=False),
        evaluate=fake_evaluate,
        say=lambda s: None,
    )
    run_curve(
        fast,
        ["recipe=eagle3", "drafter.ttt_steps=5"],
        [10, 100, 1000],
        settings,
        runner=FakeTraining(checkpoints=False),
        evaluate=fake_evaluate,
        say=lambda s: None,
    )
    _bill(fast, 0.36 / 10)
    _bill(slow, 0.36)
    out = tmp_path / "compare"
    assert compare([slow, fast], out)["picked"] == str(fast)
    return out


def test_curves_are_compared_at_equal_cpu_hours_and_the_pick_says_its_noise(tmp_path):
    out = _compared(tmp_path)
    chosen = json.loads((out / "compare.json").read_text())["pick"]
    assert chosen["equal_cpu_hours"]["budget"] == pytest.approx(
        100_000 * 0.36 / 3600
    )  # the most both reached
    assert chosen["picked"]["overrides"] == [
        "recipe=eagle3",
        "drafter.ttt_steps=5",
    ]  # the curve's defaults dropped
    assert chosen["equal_tokens"]["budget"] == 100_000
    lead = chosen[
        "picked"
    ]  # 0.768 against 0.737 over 400 verified steps each: inside two standard errors
    assert lead["margin"] == pytest.approx(0.031, abs=0.002)
    assert lead["noise"] == pytest.approx(
        math.sqrt(0.768 * 0.232 / 400 + 0.737 * 0.263 / 400), abs=0.003
    )
    assert lead["decisive"] is False
    assert (
        "Picked" in (out / "compare.md").read_text()
        and "not decisive" in (out / "compare.md").read_text()
    )


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_train_best_trains_the_picked_recipe(tmp_path):
    out = _compared(tmp_path)
    dry = subprocess.run(
        [
            "make",
            "-n",
            "train-best",
            f"BEST_COMPARE={out / 'compare.json'}",
            "BEST_PRECISION=32-true",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = dry.splitlines()
    train = next(i for i, line in enumerate(lines) if "flagship train" in line)
    assert "recipe=eagle3 drafter.ttt_steps=5 trainer.max_steps=" in " ".join(
        lines[train : train + 2]
    ), lines
