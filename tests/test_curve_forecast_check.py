"""The forecast interval of the learning curve and its check against a finished run (issue 49
item 1): the 90% interval covers the truth on noisy curves, and `draftsmith curve --check`
evaluates a run trained past the curve, records whether it landed inside, and refuses in one line a
run it cannot check."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from curve_fakes import FakeTraining, fake_evaluate, law

from draftsmith.evals.curve_check import run_check
from draftsmith.evals.curve_forecast import check, predict
from draftsmith.evals.curve_report import write_report
from draftsmith.evals.curve_runner import CurveError, run_curve
from draftsmith.evals.learning_curve import EvalSettings

pytestmark = pytest.mark.unit
SETTINGS = EvalSettings(prompt_sets=("mtbench", "humaneval"))


def quiet(_: str) -> None:
    """Progress lines the tests do not read."""


def _noisy_points(truth, budgets: list[float], trials: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    points = []
    for tokens in budgets:
        p = truth(tokens)
        # a binomial reading of the true value
        measured = sum(rng.random() < p for _ in range(trials)) / trials
        points.append(
            {
                "tokens": tokens,
                "eval": {
                    "mtbench": {"first_position_acceptance": measured, "verify_steps": trials}
                },
            }
        )
    return points


def test_the_forecast_interval_covers_the_truth_and_a_check_says_so(tmp_path):
    def truth(t: float) -> float:
        return 0.7 - 3.0 * t**-0.3

    budgets = [2e4 * 2**i for i in range(6)]
    inside = 0
    for seed in range(10):
        guess = predict(_noisy_points(truth, budgets, 600, seed), "mtbench", budgets[-1] * 4)
        inside += guess["interval"][0] <= truth(budgets[-1] * 4) <= guess["interval"][1]
    assert inside >= 8  # a 90% interval, on ten independent curves
    data = {"settings": {"prompt_sets": ["mtbench"]}, "points": _noisy_points(truth, budgets, 600)}
    at = int(budgets[-1] * 4)
    ok = check(data, "cosine_run", at, {"mtbench": {"first_position_acceptance": truth(at)}})
    far = check(data, "cosine_run", at, {"mtbench": {"first_position_acceptance": 0.95}})
    assert (
        ok["all_inside"] is True
        and far["all_inside"] is False
        and far["sets"]["mtbench"]["inside"] is False
    )


def test_check_evaluates_a_finished_run_past_the_curve_and_refuses_what_it_cannot_check(
    tmp_path, medusa_export
):
    curve_dir = tmp_path / "curve"
    run_curve(
        curve_dir,
        ["recipe=medusa"],
        [10, 30, 100, 300],
        SETTINGS,
        runner=FakeTraining(),
        evaluate=fake_evaluate,
        say=quiet,
        cooldown=0.2,
    )
    write_report(curve_dir, json.loads((curve_dir / "curve.json").read_text()))
    run = tmp_path / "cosine"
    shutil.copytree(medusa_export, run / "export")
    config = json.loads((run / "export" / "config.json").read_text())
    for tokens, refused in ((300_000, True), (3_000_000, False)):
        config["training"] = {"tokens": tokens, "steps": tokens // 1000}
        (run / "export" / "config.json").write_text(json.dumps(config))
        if refused:  # the cooled reading at step 360 has 360k tokens: a check needs more
            with pytest.raises(
                CurveError, match="not more than the curve's furthest reading \\(360,000\\)"
            ):
                run_check(curve_dir, run, evaluate=fake_evaluate, say=quiet)
    record = run_check(
        curve_dir,
        run,
        say=quiet,
        evaluate=lambda e, s, measure=False: fake_evaluate(e, s, measure, steps=3000, cooled=True),
    )
    assert record["sets"]["mtbench"]["measured"] == pytest.approx(law(3_000_000, cooled=True))
    assert record["all_inside"] is True
    assert "Forecast check" in (curve_dir / "curve.md").read_text()
    assert len(json.loads((curve_dir / "curve.json").read_text())["checks"]) == 1
    weights = run / "export" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CurveError, match="corrupt or truncated") as err:
        run_check(curve_dir, run, evaluate=fake_evaluate, say=quiet)
    assert "\n" not in str(err.value)


def test_the_cli_checks_a_run_and_refuses_one_it_cannot_check_in_one_line(
    tmp_path, medusa_export, capsys
):
    from draftsmith.cli.curve import cmd_curve

    curve_dir = tmp_path / "curve"
    run_curve(
        curve_dir,
        ["recipe=medusa"],
        [10, 30, 100],
        SETTINGS,
        runner=FakeTraining(),
        evaluate=fake_evaluate,
        say=quiet,
        cooldown=0.2,
    )
    write_report(curve_dir, json.loads((curve_dir / "curve.json").read_text()))
    # its training block: 0 tokens
    assert cmd_curve(["--out", str(curve_dir), "--check", str(medusa_export)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not more than the curve's furthest reading (120,000)" in err[0]
    assert cmd_curve(["--out", str(tmp_path / "none"), "--check", str(medusa_export)]) == 1
    assert "curve.json not found: run the curve first" in capsys.readouterr().err
