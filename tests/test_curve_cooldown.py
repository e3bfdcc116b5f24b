"""Cooldown branches of the learning curve (issue 49 item 1): each point is read raw and after a
branch whose LR decays linearly to zero, the main run untouched; the fit, the forecast interval and
``--compare`` read the cooled values; a killed branch resumes, a damaged one is refused in one line;
a bad prompt set is refused before training. The forecast check is in
tests/test_curve_forecast_check.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from curve_fakes import COOLED_GAIN, FakeTraining, fake_evaluate

from draftsmith.common.errors import ConfigError
from draftsmith.distill.engine.schedule import lr_lambda
from draftsmith.evals.cooldown import BranchError, branch_overrides, decay_steps
from draftsmith.evals.curve_compare import compare
from draftsmith.evals.curve_report import write_report
from draftsmith.evals.curve_runner import CurveError, run_curve
from draftsmith.evals.learning_curve import EvalSettings

pytestmark = pytest.mark.unit
SETTINGS = EvalSettings(prompt_sets=("mtbench", "humaneval"))


def quiet(_: str) -> None:
    """Progress lines the tests do not read."""


def test_wsd_schedule_decays_linearly_to_zero_over_its_last_steps():
    fn = lr_lambda("wsd", warmup_steps=2, total_steps=10, decay_steps=4)
    assert [fn(s) for s in range(11)] == pytest.approx(
        [0.5, 1, 1, 1, 1, 1, 1.0, 0.75, 0.5, 0.25, 0.0]
    )
    with pytest.raises(ConfigError, match="optim.decay_steps >= 1"):
        lr_lambda("wsd", 0, 10)
    assert decay_steps(30, 0.2) == 6 and decay_steps(3, 0.1) == 1
    assert branch_overrides(
        ["recipe=eagle3", "optim.scheduler=constant", "optim.decay_steps=9", "run.resume=auto"], 6
    ) == ["recipe=eagle3", "optim.scheduler=wsd", "optim.decay_steps=6", "run.resume=changed"]


def test_each_point_is_read_raw_and_cooled_and_the_fit_reads_the_cooled_values(tmp_path):
    runner = FakeTraining()
    curve = run_curve(
        tmp_path,
        ["recipe=eagle3"],
        [10, 30, 100],
        SETTINGS,
        runner=runner,
        evaluate=fake_evaluate,
        say=quiet,
        cooldown=0.2,
    )
    assert runner.calls == [10, 12, 30, 36, 100, 120]  # main to S, then its branch to S + 0.2 S
    for argv in runner.branch_argvs:
        assert "optim.scheduler=wsd" in argv and "optim.scheduler=constant" not in argv
    assert [a for a in runner.branch_argvs[1] if a.startswith("optim.decay_steps=")] == [
        "optim.decay_steps=6"
    ]
    point = curve.data["points"][1]
    assert point["cooled"]["steps"] == 36 and point["cooled"]["tokens"] == 36_000
    raw, cooled = (
        point["eval"]["mtbench"]["first_position_acceptance"],
        point["cooled"]["eval"]["mtbench"]["first_position_acceptance"],
    )
    assert cooled == pytest.approx(raw + COOLED_GAIN + 2.0 * (30_000**-0.3 - 36_000**-0.3))
    assert not (
        tmp_path / "branches" / "step30" / "checkpoints"
    ).exists()  # dropped once the export is kept
    block = write_report(tmp_path, curve.data)
    assert block["mtbench"]["values"] == "cooled"  # the cooled law: 0.8 + gain; the raw one: 0.8
    assert block["mtbench"]["fit"]["ceiling"] == pytest.approx(0.8 + COOLED_GAIN, abs=0.02)
    assert block["mtbench"]["raw_fit"]["ceiling"] == pytest.approx(0.8, abs=0.02)
    at = block["mtbench"]["at"][0]
    assert at["interval"][0] <= at["value"] <= at["interval"][1]
    table = (tmp_path / "curve.md").read_text()
    assert "| 36 (cooled) | 36,000 |" in table and "first-position (raw) | cooled |" in table
    assert "mtbench (cooled points): ceiling" in table and "90% interval" in table
    kept = json.loads(
        (tmp_path / "curve.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON")
    )
    assert kept["best_point"]["cooled"] is True


def test_a_branch_reads_the_main_runs_checkpoint_and_never_writes_the_main_run(tmp_path):
    runner = FakeTraining()
    run_curve(
        tmp_path,
        ["recipe=eagle3"],
        [10, 30],
        SETTINGS,
        runner=runner,
        evaluate=fake_evaluate,
        say=quiet,
        cooldown=0.2,
    )
    # every main-run file was as the main segment left it when its branch trained (FakeTraining
    # compares them)
    assert runner.main_snapshots_checked == 2
    seed_state = runner.seen_seeds[0]
    assert seed_state == {
        "global_step": 10,
        "weights": 10,
    }  # the branch started from the main run's step 10


def _kill_at(folder, steps: int, plan: list[int], evaluate=fake_evaluate) -> FakeTraining:
    """Run a cooled curve of ``plan`` in ``folder`` until its training reaches ``steps`` (then
    interrupted); the training."""
    runner = FakeTraining(stop_at=steps)
    with pytest.raises(KeyboardInterrupt):
        cooled_curve(folder, plan, runner, evaluate)
    return runner


def cooled_curve(folder, plan: list[int], runner: FakeTraining, evaluate=fake_evaluate):
    """A curve of ``plan`` in ``folder`` whose points are also read after a 20% cooldown."""
    return run_curve(
        folder,
        ["recipe=eagle3"],
        plan,
        SETTINGS,
        runner=runner,
        evaluate=evaluate,
        say=quiet,
        cooldown=0.2,
    )


def test_a_killed_branch_resumes_without_training_the_main_run_again(tmp_path):
    evaluations: list[str] = []

    def counting(export, settings, measure=False):
        evaluations.append(export)
        return fake_evaluate(export, settings, measure)

    first = _kill_at(tmp_path, 36, [10, 30, 100], counting)
    assert first.calls == [10, 12, 30]
    seed = tmp_path / "branches" / "step30" / "checkpoints" / "step30.ckpt"
    assert seed.is_file() and torch.load(seed, weights_only=True)["global_step"] == 30
    raw_evals = len(evaluations)
    again = FakeTraining()
    cooled_curve(tmp_path, [10, 30, 100], again, counting)
    assert again.calls == [
        36,
        100,
        120,
    ]  # the branch resumed; the main run was not trained again to 30
    assert len(evaluations) == raw_evals + 3  # step 30's raw evaluation was kept, not redone


def test_a_damaged_branch_is_refused_in_one_line(tmp_path):
    _kill_at(tmp_path, 12, [10, 30])
    damaged = tmp_path / "branches" / "step10" / "checkpoints" / "step10.ckpt"
    damaged.write_bytes(damaged.read_bytes()[:40])  # a partial file
    with pytest.raises(BranchError) as err:
        cooled_curve(tmp_path, [10, 30], FakeTraining())
    assert "is corrupt or partial" in str(err.value) and "\n" not in str(err.value)
    assert "re-run the same command to branch again" in str(err.value)


def test_bad_prompt_sets_and_cooldowns_are_refused_before_any_training(tmp_path):
    runner = FakeTraining()
    with pytest.raises(CurveError, match=r"--prompts nosuch: .*nothing was trained"):
        run_curve(
            tmp_path,
            ["recipe=eagle3"],
            [10],
            EvalSettings(prompt_sets=("mtbench", "nosuch")),
            runner=runner,
            evaluate=fake_evaluate,
            say=quiet,
        )
    with pytest.raises(BranchError, match="optim.scheduler=cosine"):
        run_curve(
            tmp_path,
            ["recipe=eagle3", "optim.scheduler=cosine"],
            [10],
            SETTINGS,
            runner=runner,
            evaluate=fake_evaluate,
            say=quiet,
            cooldown=0.2,
        )
    with pytest.raises(BranchError, match=r"must be in \[0, 1\]"):
        run_curve(
            tmp_path,
            ["recipe=eagle3"],
            [10],
            SETTINGS,
            runner=runner,
            evaluate=fake_evaluate,
            say=quiet,
            cooldown=1.5,
        )
    assert runner.calls == [] and not (tmp_path / "curve.json").exists()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftsmith.cli",
            "curve",
            "--out",
            str(tmp_path / "c"),
            "--prompts",
            "nosuch",
            "recipe=eagle3",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1 and not (tmp_path / "c" / "run").exists()
    assert proc.stderr.strip().splitlines() == [
        "draftsmith curve: error: --prompts nosuch: no such file, and not a prompt set (mtbench,"
        ' humaneval, sharegpt); pass a .jsonl with one {"prompt": "..."} per line, or a .txt with'
        " one prompt per line; nothing was trained"
    ]


def test_compare_reads_the_cooled_points(tmp_path):
    slow, fast = tmp_path / "slow", tmp_path / "fast"
    run_curve(
        slow,
        ["recipe=eagle3"],
        [10, 100],
        SETTINGS,
        runner=FakeTraining(),
        evaluate=fake_evaluate,
        say=quiet,
        cooldown=0.2,
    )
    run_curve(
        fast,
        ["recipe=eagle3", "drafter.ttt_steps=5"],
        [10, 100],
        SETTINGS,
        runner=FakeTraining(),
        evaluate=fake_evaluate,
        say=quiet,
        cooldown=0.0,
    )  # no branches: read raw
    compare([slow, fast], tmp_path / "cmp")
    chosen = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    at_tokens = chosen["pick"]["equal_tokens"]
    assert (
        at_tokens["curves"][str(slow)]["values"] == "cooled"
        and at_tokens["curves"][str(fast)]["values"] == "raw"
    )
    assert at_tokens["budget"] == 100_000  # the raw curve reaches 100k; the cooled one 120k
    # the cooled law, interpolated between 12k and 120k
    expected = 0.8 - 2.0 * 100_000**-0.3 + COOLED_GAIN
    assert at_tokens["curves"][str(slow)]["first_position"]["mtbench"] == pytest.approx(
        expected, abs=0.01
    )
    assert chosen["pick"]["equal_cpu_hours"]["curves"][str(slow)]["values"] == "cooled"
    assert {r["values"] for r in chosen["rows"]} == {"cooled", "raw"}
    assert "are read raw" in (tmp_path / "cmp" / "compare.md").read_text()
