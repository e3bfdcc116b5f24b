"""The learning curve's runs (`draftsmith curve`): resuming after an interrupt without retraining
or re-evaluating kept points, reporting and comparing curves, extending a finished curve, refusing a
folder started otherwise, billing a cached curve its feature cache's build, and refusing the keys
the curve sets itself, bad prompts and misspelt training keys before any training.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from curve_fakes import ContendedThenQuietEvaluation, FakeTraining, fake_evaluate

from draftsmith.cli import main
from draftsmith.evals.curve_compare import compare
from draftsmith.evals.curve_report import settle_cpu_hours, write_report
from draftsmith.evals.curve_runner import CurveError, run_curve
from draftsmith.evals.learning_curve import EvalSettings

pytestmark = pytest.mark.unit
PLAN = [10, 30, 100, 300]


def quiet(_: str) -> None:
    """Progress lines the tests do not read."""


def _interrupted_then_resumed(folder: Path, evaluate) -> tuple[FakeTraining, object]:
    """A four-point curve interrupted while training its third point, then run again to the end;
    the second run's training and its curve."""
    settings = EvalSettings(prompt_sets=("mtbench", "humaneval"))
    first = FakeTraining(stop_at=100, checkpoints=False)
    with pytest.raises(KeyboardInterrupt):
        run_curve(
            folder, ["recipe=eagle3"], PLAN, settings, runner=first, evaluate=evaluate, say=quiet
        )
    assert first.calls == [10, 30]
    kept = json.loads((folder / "curve.json").read_text())
    assert [p["steps"] for p in kept["points"]] == [10, 30]
    assert "optim.scheduler=constant" in kept["overrides"]
    second = FakeTraining(checkpoints=False)
    curve = run_curve(
        folder, ["recipe=eagle3"], PLAN, settings, runner=second, evaluate=evaluate, say=quiet
    )
    return second, curve


def test_an_interrupted_curve_resumes_without_redoing_finished_points(tmp_path):
    evaluate = ContendedThenQuietEvaluation()
    second, curve = _interrupted_then_resumed(tmp_path, evaluate)
    assert second.calls == [100, 300]  # the kept points were neither retrained nor re-evaluated
    assert [p["tokens"] for p in curve.data["points"]] == [10_000, 30_000, 100_000, 300_000]
    # contended costs at the first point, measured again (quiet) at the next, then kept
    assert evaluate.measured == 2
    assert not curve.data["costs_contention"]["contended"]


def test_a_resumed_curve_is_reported_with_the_quiet_costs(tmp_path):
    _, curve = _interrupted_then_resumed(tmp_path, ContendedThenQuietEvaluation())
    block = write_report(tmp_path, curve.data)
    assert block["mtbench"]["fit"]["ceiling"] == pytest.approx(0.8, abs=0.02)
    reported = json.loads((tmp_path / "curve.json").read_text())["points"]
    # every point predicted with the same (quiet) costs: 2-node verify 12 ms + 0.5 + 0.2
    for p in reported:
        first = p["eval"]["mtbench"]["first_position_acceptance"]
        speedup = (1 + first) / (12.0 + 0.5 + 0.2) * 10.0
        expected = "chain:1" if speedup > 1 else "plain"
        assert p["eval"]["mtbench"]["cost_aware"]["shape"] == expected
    assert (tmp_path / "curve.png").stat().st_size > 1000
    table = (tmp_path / "curve.md").read_text()
    assert "| 300 | 300,000 |" in table and "first-position" in table


def test_two_curves_are_compared_side_by_side(tmp_path):
    _interrupted_then_resumed(tmp_path, ContendedThenQuietEvaluation())
    other = tmp_path / "other"
    run_curve(
        other,
        ["recipe=eagle3", "drafter.ttt_steps=5"],
        [10, 30, 100],
        EvalSettings(prompt_sets=("mtbench", "humaneval")),
        runner=FakeTraining(checkpoints=False),
        evaluate=fake_evaluate,
        say=quiet,
    )
    side = compare([tmp_path, other], tmp_path / "compare")
    assert side["rows"] == 2 * (4 + 3)
    assert "drafter.ttt_steps=5" in (tmp_path / "compare" / "compare.md").read_text()
    assert (tmp_path / "compare" / "compare.png").stat().st_size > 1000


def test_a_folder_started_with_another_plan_is_refused(tmp_path):
    second, _ = _interrupted_then_resumed(tmp_path, ContendedThenQuietEvaluation())
    with pytest.raises(CurveError, match="re-run with the same arguments"):
        run_curve(
            tmp_path,
            ["recipe=eagle3"],
            [10, 200],
            EvalSettings(prompt_sets=("mtbench", "humaneval")),
            runner=second,
            evaluate=fake_evaluate,
            say=quiet,
        )


def test_a_larger_steps_extends_a_finished_curve_keeping_its_points(tmp_path):
    settings = EvalSettings(prompt_sets=("mtbench",))
    first = FakeTraining(checkpoints=False)
    run_curve(
        tmp_path,
        ["recipe=eagle3"],
        [10, 30, 100],
        settings,
        runner=first,
        evaluate=fake_evaluate,
        say=lambda s: None,
    )
    longer, said = FakeTraining(checkpoints=False), []
    curve = run_curve(
        tmp_path,
        ["recipe=eagle3"],
        [10, 32, 100, 316, 1000],
        settings,
        runner=longer,
        evaluate=fake_evaluate,
        say=said.append,
    )
    assert longer.calls == [316, 1000]  # only the points beyond the kept run's end are trained
    assert [p["steps"] for p in curve.data["points"]] == [10, 30, 100, 316, 1000]
    assert "extending the kept curve" in said[0]
    again = FakeTraining(checkpoints=False)  # the extending command re-run: nothing left to do
    run_curve(
        tmp_path,
        ["recipe=eagle3"],
        [10, 32, 100, 316, 1000],
        settings,
        runner=again,
        evaluate=fake_evaluate,
        say=lambda s: None,
    )
    assert again.calls == []
    with pytest.raises(CurveError, match="a larger --steps to extend it"):
        run_curve(
            tmp_path,
            ["recipe=eagle3"],
            [10, 500],
            settings,
            runner=again,
            evaluate=fake_evaluate,
            say=lambda s: None,
        )


def _fake_feature_cache(folder: Path, shard_cpu: list[float | None], train_tokens: int) -> Path:
    """A feature-cache folder as the curve reads it: a manifest and shards whose headers carry their
    build cost."""
    import torch

    from draftsmith.common.cache_costs import record_build_cost
    from draftsmith.distill.feature_cache.shards import write_shard

    folder.mkdir(parents=True)
    shards = [{"file": f"shard-{i:05d}.safetensors", "tokens": 100} for i in range(len(shard_cpu))]
    for shard, cpu in zip(shards, shard_cpu):
        write_shard(folder / shard["file"], {"x": torch.zeros(2)}, {})
        if cpu is not None:
            record_build_cost(folder, shard["file"], cpu)
    (folder / "manifest.json").write_text(
        json.dumps({"shards": shards, "nonpad_tokens": {"train": train_tokens}})
    )
    return folder


def _cached_curve(folder: Path, cache: Path, plan: list[int], said: list[str]):
    """A curve of ``plan`` trained from the feature cache ``cache``."""
    return run_curve(
        folder,
        ["recipe=eagle3", f"data.features={cache}"],
        plan,
        EvalSettings(prompt_sets=("mtbench",)),
        runner=FakeTraining(checkpoints=False),
        evaluate=fake_evaluate,
        say=said.append,
    )


def test_a_curve_trained_from_a_feature_cache_is_billed_its_build_over_the_first_epoch(tmp_path):
    """Equal CPU-hours must mean equal work: a cached curve pays the target's pass that wrote its
    cache, in proportion to the first epoch's tokens it has used, then all of it."""
    cache = _fake_feature_cache(tmp_path / "features", [1800.0, 1800.0], train_tokens=20_000)
    said: list[str] = []
    curve = _cached_curve(tmp_path / "curve", cache, [10, 20, 40], said)
    points = curve.data[
        "points"
    ]  # FakeTraining: 1,000 tokens a step, no CPU of its own (in-process)
    assert [p["cache_cpu_seconds"] for p in points] == pytest.approx([1800.0, 3600.0, 3600.0])
    assert [p["cpu_hours"] for p in points] == pytest.approx([0.5, 1.0, 1.0], abs=0.01)
    assert [p["cpu_hours"] for p in settle_cpu_hours(points)] == pytest.approx(
        [0.5, 1.0, 1.0], abs=0.01
    )
    write_report(tmp_path / "curve", curve.data)
    table = (tmp_path / "curve" / "curve.md").read_text()
    assert "feature cache's build (1.00 CPU-h for 20,000 training tokens" in table
    assert not said[0].startswith("the feature cache")


def test_a_feature_cache_with_a_cost_not_kept_is_estimated_or_said(tmp_path):
    killed = _fake_feature_cache(
        tmp_path / "killed", [1800.0, None], train_tokens=20_000
    )  # one cost not kept
    curve = _cached_curve(tmp_path / "killed_curve", killed, [40], [])
    assert curve.data["points"][0]["cache_cpu_seconds"] == pytest.approx(
        3600.0
    )  # estimated at the other's rate
    old = _fake_feature_cache(
        tmp_path / "old", [None, None], train_tokens=20_000
    )  # written before costs were kept
    said: list[str] = []
    curve = _cached_curve(tmp_path / "old_curve", old, [10], said)
    assert curve.data["points"][0]["cache_cpu_seconds"] is None
    assert "did not record what it cost to build" in said[0]
    with pytest.raises(
        CurveError, match="no manifest.json there; build it first with `draftsmith cache-features"
    ):
        run_curve(
            tmp_path / "none",
            ["recipe=eagle3", f"data.features={tmp_path / 'missing'}"],
            [10],
            EvalSettings(),
            runner=FakeTraining(checkpoints=False),
            evaluate=fake_evaluate,
            say=said.append,
        )


def test_the_curve_refuses_keys_it_sets_itself_and_a_missing_recipe(tmp_path):
    with pytest.raises(CurveError, match="trainer.max_steps is set by the curve"):
        run_curve(
            tmp_path,
            ["recipe=eagle3", "trainer.max_steps=5"],
            [1],
            EvalSettings(),
            runner=FakeTraining(checkpoints=False),
        )
    proc = subprocess.run(
        [sys.executable, "-m", "draftsmith.cli", "curve", "--out", str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "draftsmith curve: error: name a recipe, e.g. `draftsmith curve --out DIR recipe=eagle3`"
    ]


def test_curve_refuses_bad_prompts_before_any_training(capsys, tmp_path, monkeypatch):
    """`curve --prompts nosuch` was refused only after a training segment."""
    from draftsmith.evals import curve_runner

    def trained(*args, **kwargs):
        raise AssertionError("a training segment ran before the prompts were checked")

    monkeypatch.setattr(curve_runner, "run_curve", trained)
    code = main(
        [
            "curve",
            "--prompts",
            "nosuch",
            "--out",
            str(tmp_path / "c"),
            "--steps",
            "2",
            "--first-steps",
            "1",
            "--points",
            "1",
            "recipe=medusa",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and "prompts nosuch: no such file" in err and "Traceback" not in err
    assert not (tmp_path / "c").exists()


def test_curve_refuses_a_misspelt_training_key_before_any_training(capsys, tmp_path, monkeypatch):
    """The training segment printed its error line, then the curve printed a second one."""
    from draftsmith.evals import curve_runner

    monkeypatch.setattr(
        curve_runner, "run_curve", lambda *a, **k: pytest.fail("a training segment ran")
    )
    code = main(
        [
            "curve",
            "--out",
            str(tmp_path / "c"),
            "--steps",
            "2",
            "--first-steps",
            "1",
            "--points",
            "1",
            "recipe=medusa",
            "heads.num_head=3",
        ]
    )
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert (
        code == 1 and len(err) == 1 and "heads.num_head is not a key of recipe=medusa" in err[0]
    ), err
