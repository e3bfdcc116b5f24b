"""The learning curve (`draftsmith curve`): log-spaced plan, the saturating fit and its forecast,
resuming after an interrupt without retraining or re-evaluating kept points, refusing a folder
started otherwise, the per-position acceptance read from recorded trees, and a real evaluation of a
tiny export in the runtime's own loop.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from pattern_target import write_heldout_prompts

from draftsmith.evals.curve_compare import compare
from draftsmith.evals.curve_fit import fit_curve, forecast
from draftsmith.evals.curve_folder import CurveError
from draftsmith.evals.curve_report import best_point, settle_cpu_hours, write_report
from draftsmith.evals.curve_runner import log_spaced_steps, run_curve
from draftsmith.evals.learning_curve import (
    EvalSettings,
    chain_acceptance,
    conditional,
    cost_aware,
    coverage,
    draft_vocabulary,
    evaluate_export,
)
from draftsmith.runtime.shapes.cost_model import MachineCosts
from draftsmith.runtime.shapes.draft_shapes import RecordedStep

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]


def test_plan_is_log_spaced_increasing_and_ends_at_the_budget():
    plan = log_spaced_steps(10, 1000, 5)
    assert plan == [10, 32, 100, 316, 1000]
    assert log_spaced_steps(1, 3, 6) == [1, 2, 3]  # rounding collapses duplicates
    with pytest.raises(CurveError, match="first-steps"):
        log_spaced_steps(100, 10, 3)


def test_fit_recovers_a_known_curve_and_forecasts_the_tokens_of_a_target():
    tokens = [1e4 * 3**i for i in range(7)]
    truth = [0.8 - 2.0 * t**-0.3 for t in tokens]
    fit = fit_curve(tokens, truth)
    assert fit is not None and fit.rmse < 1e-3
    assert fit.ceiling == pytest.approx(0.8, abs=0.01) and fit.exponent == pytest.approx(
        0.3, abs=0.03
    )
    need = fit.tokens_for(0.75)
    assert need == pytest.approx((2.0 / 0.05) ** (1 / 0.3), rel=0.25)
    assert fit.tokens_for(0.9) is None  # above the ceiling: unreachable with this recipe
    flat = fit.flattens_at
    assert flat is not None and fit.at(2 * flat) - fit.at(flat) == pytest.approx(0.01, rel=0.1)
    assert fit_curve(tokens[:2], truth[:2]) is None
    steep = [
        0.1 * math.log(t) - 0.9 for t in tokens
    ]  # still rising in log: the fit never places a ceiling above 1
    assert (fit_curve(tokens, steep) or fit).ceiling <= 1.0
    capped = fit_curve(
        tokens, truth, bound=0.7
    )  # a draft vocabulary covering 70% of the target's greedy tokens
    assert capped is None or capped.ceiling <= 0.7


def test_a_target_above_the_draft_vocabularys_coverage_is_named_unreachable():
    tokens = [1e4 * 3**i for i in range(7)]
    fit = fit_curve(tokens, [0.8 - 2.0 * t**-0.3 for t in tokens])
    out = forecast(fit, {"first_position": 0.75}, 1e5, coverage=0.72)
    target = out["targets"]["first_position"]
    assert not target["reachable"] and target["tokens"] is None
    assert (
        "above the draft vocabulary's coverage" in target["why"]
        and "drafter.draft_vocab_size" in target["why"]
    )
    assert forecast(fit, {"first_position": 0.75}, 1e5, coverage=0.95)["targets"]["first_position"][
        "reachable"
    ]


def _step(accepted_depth: int, depth: int = 4) -> RecordedStep:
    """A recorded chain of ``depth`` drafted nodes whose first ``accepted_depth`` were accepted."""
    parents = [-1, *range(depth)]
    return RecordedStep(
        parents, list(range(depth + 1)), [1.0] * (depth + 1), list(range(accepted_depth + 1))
    )


def test_chain_acceptance_is_cumulative_and_conditional_divides_it():
    steps = [_step(0), _step(1), _step(2), _step(4)]
    cumulative = chain_acceptance(steps)
    assert cumulative == [0.75, 0.5, 0.25, 0.25]
    assert conditional(cumulative) == pytest.approx([0.75, 2 / 3, 0.5, 1.0])


class FakeTraining:
    """Stands in for `draftsmith train`: writes the run's export and a CSV with the tokens seen at
    each segment."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.calls: list[int] = []
        self.stop_at = stop_at

    def __call__(self, argv: list[str]) -> int:
        run = Path(next(a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")))
        steps = int(next(a.split("=", 1)[1] for a in argv if a.startswith("trainer.max_steps=")))
        if steps == self.stop_at:
            raise KeyboardInterrupt
        self.calls.append(steps)
        (run / "export").mkdir(parents=True, exist_ok=True)
        (run / "export" / "config.json").write_text(json.dumps({"method": "fake", "steps": steps}))
        (run / "logs").mkdir(exist_ok=True)
        (run / "logs" / "metrics.csv").write_text(
            "step,train/tokens\n" + f"{steps},{steps * 1000}\n"
        )
        return 0


MEASURED: list[bool] = []


def fake_evaluate(export: str, settings, measure=False):
    """Acceptance rising with the step count; costs 'measured' contended at the first point, quiet
    later."""
    steps = json.loads((Path(export) / "config.json").read_text())["steps"]
    first = 0.8 - 2.0 * (steps * 1000) ** -0.3
    chain = [first, first * 0.7, first * 0.5, first * 0.3]
    table = [
        {
            "shape": "chain:1",
            "depth": 1,
            "tokens": 1 + first,
            "nodes": 2.0,
            "node_counts": {"2": 10},
        }
    ]
    record = {
        "first_position_acceptance": first,
        "chain_acceptance": chain,
        "conditional_acceptance": conditional(chain),
        "shapes": table,
        "verify_steps": 400,
    }
    measured = None
    if measure:
        MEASURED.append(True)
        busy = len(MEASURED) == 1
        verify = (
            50.0 if busy else 12.0
        )  # contended costs make a 2-node verify look dearer than it is
        measured = {
            "costs": asdict(MachineCosts(10.0, {1: 10.0, 2: verify}, 0.5, 0.2)),
            "contention": {"contended": busy, "others_cpu_share": 0.6 if busy else 0.0},
        }
    return {name: record for name in settings.prompt_sets}, measured


def test_an_interrupted_curve_resumes_without_redoing_finished_points(tmp_path):
    settings = EvalSettings(prompt_sets=("mtbench", "humaneval"))
    plan = [10, 30, 100, 300]
    first = FakeTraining(stop_at=100)
    with pytest.raises(KeyboardInterrupt):
        run_curve(
            tmp_path,
            ["recipe=eagle3"],
            plan,
            settings,
            runner=first,
            evaluate=fake_evaluate,
            say=lambda s: None,
        )
    assert first.calls == [10, 30]
    kept = json.loads((tmp_path / "curve.json").read_text())
    assert [p["steps"] for p in kept["points"]] == [10, 30]
    assert "optim.scheduler=constant" in kept["overrides"]

    second = FakeTraining()
    curve = run_curve(
        tmp_path,
        ["recipe=eagle3"],
        plan,
        settings,
        runner=second,
        evaluate=fake_evaluate,
        say=lambda s: None,
    )
    assert second.calls == [100, 300]  # the kept points were neither retrained nor re-evaluated
    assert [p["tokens"] for p in curve.data["points"]] == [10_000, 30_000, 100_000, 300_000]
    assert (
        len(MEASURED) == 2
    )  # contended costs at the first point, measured again (quiet) at the next, then kept
    assert not curve.data["costs_contention"]["contended"]
    block = write_report(tmp_path, curve.data)
    assert block["mtbench"]["fit"]["ceiling"] == pytest.approx(0.8, abs=0.02)
    reported = json.loads((tmp_path / "curve.json").read_text())["points"]
    for p in (
        reported
    ):  # every point predicted with the same (quiet) costs: 2-node verify 12 ms + 0.5 + 0.2
        first = p["eval"]["mtbench"]["first_position_acceptance"]
        speedup = (1 + first) / (12.0 + 0.5 + 0.2) * 10.0
        expected = "chain:1" if speedup > 1 else "plain"
        assert p["eval"]["mtbench"]["cost_aware"]["shape"] == expected
    assert (tmp_path / "curve.png").stat().st_size > 1000
    table = (tmp_path / "curve.md").read_text()
    assert "| 300 | 300,000 |" in table and "first-position" in table

    other = tmp_path / "other"
    run_curve(
        other,
        ["recipe=eagle3", "drafter.ttt_steps=5"],
        [10, 30, 100],
        settings,
        runner=FakeTraining(),
        evaluate=fake_evaluate,
        say=lambda s: None,
    )
    side = compare([tmp_path, other], tmp_path / "compare")
    assert side["rows"] == 2 * (4 + 3)
    assert "drafter.ttt_steps=5" in (tmp_path / "compare" / "compare.md").read_text()
    assert (tmp_path / "compare" / "compare.png").stat().st_size > 1000

    with pytest.raises(CurveError, match="re-run with the same arguments"):
        run_curve(
            tmp_path,
            ["recipe=eagle3"],
            [10, 200],
            settings,
            runner=second,
            evaluate=fake_evaluate,
            say=lambda s: None,
        )


def test_a_larger_steps_extends_a_finished_curve_keeping_its_points(tmp_path):
    settings = EvalSettings(prompt_sets=("mtbench",))
    first = FakeTraining()
    run_curve(
        tmp_path,
        ["recipe=eagle3"],
        [10, 30, 100],
        settings,
        runner=first,
        evaluate=fake_evaluate,
        say=lambda s: None,
    )
    longer, said = FakeTraining(), []
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
    again = FakeTraining()  # the extending command re-run: nothing left to do
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


def test_a_curve_trained_from_a_feature_cache_is_billed_its_build_over_the_first_epoch(tmp_path):
    """Equal CPU-hours must mean equal work: a cached curve pays the target's pass that wrote its
    cache, in proportion to the first epoch's tokens it has used, then all of it."""
    cache = _fake_feature_cache(tmp_path / "features", [1800.0, 1800.0], train_tokens=20_000)
    said: list[str] = []
    curve = run_curve(
        tmp_path / "curve",
        ["recipe=eagle3", f"data.features={cache}"],
        [10, 20, 40],
        EvalSettings(prompt_sets=("mtbench",)),
        runner=FakeTraining(),
        evaluate=fake_evaluate,
        say=said.append,
    )
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

    killed = _fake_feature_cache(
        tmp_path / "killed", [1800.0, None], train_tokens=20_000
    )  # one cost not kept
    curve = run_curve(
        tmp_path / "killed_curve",
        ["recipe=eagle3", f"data.features={killed}"],
        [40],
        EvalSettings(prompt_sets=("mtbench",)),
        runner=FakeTraining(),
        evaluate=fake_evaluate,
        say=said.append,
    )
    assert curve.data["points"][0]["cache_cpu_seconds"] == pytest.approx(
        3600.0
    )  # estimated at the other's rate
    old = _fake_feature_cache(
        tmp_path / "old", [None, None], train_tokens=20_000
    )  # written before costs were kept
    said.clear()
    curve = run_curve(
        tmp_path / "old_curve",
        ["recipe=eagle3", f"data.features={old}"],
        [10],
        EvalSettings(prompt_sets=("mtbench",)),
        runner=FakeTraining(),
        evaluate=fake_evaluate,
        say=said.append,
    )
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
            runner=FakeTraining(),
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
            runner=FakeTraining(),
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


def test_evaluating_a_tiny_export_records_acceptance_by_position_and_a_cost_aware_shape(
    tmp_path, medusa_export
):
    prompts = write_heldout_prompts(tmp_path / "heldout.jsonl", count=2)
    settings = EvalSettings(prompt_sets=(str(prompts),), prompts=2, max_new_tokens=24, dtype="fp32")
    result, measured = evaluate_export(str(medusa_export), settings, measure=True)
    record = result[str(prompts)]
    assert (
        measured is not None
        and measured["costs"]["ar_step_ms"] > 0
        and "contended" in measured["contention"]
    )
    assert record["verify_steps"] > 0 and record["generated_tokens"] > 0
    cumulative = record["chain_acceptance"]
    assert len(cumulative) == 4 and all(a >= b for a, b in zip(cumulative, cumulative[1:]))
    assert record["first_position_acceptance"] == cumulative[0]
    assert record["chain_tau"]["chain:1"] == pytest.approx(1 + cumulative[0])
    costs = MachineCosts(**{**measured["costs"]})
    aware = cost_aware(record["shapes"], costs)
    labels = {r["shape"] for r in record["shapes"]}
    assert {
        "chain:1",
        "chain:2",
    } <= labels  # 2 heads: chains of 1 and 2 and aware["shape"] in labels | {"plain"}
    assert aware["predicted_speedup"] >= 1.0  # plain decoding (1.0) is always a candidate
    assert math.isfinite(aware["tau"]) and aware["tau"] >= 1.0


def test_draft_vocabulary_coverage_counts_tokens_the_drafter_cannot_draft(tmp_path):
    import torch
    from safetensors.torch import save_file

    from draftsmith.runtime.decoding.speculative import SpecResult

    save_file(
        {"d2t": torch.tensor([0, 4, 8])}, str(tmp_path / "model.safetensors")
    )  # draft ids 0,1,2 -> 0,5,10
    vocab = draft_vocabulary(str(tmp_path))
    assert vocab == {0, 5, 10}
    results = [SpecResult([0, 5, 7, 10], 4, [0] * 4, []), SpecResult([3], 1, [0], [])]
    assert coverage(results, vocab) == pytest.approx(3 / 5)
    assert coverage(results, None) is None


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


def test_curves_are_compared_at_equal_cpu_hours_and_train_best_trains_the_pick(tmp_path):
    from draftsmith.evals.curve_pick import CURVE_DEFAULTS, interpolate
    from draftsmith.evals.curve_training import DEFAULT_OVERRIDES

    assert set(CURVE_DEFAULTS) == {f"{k}={v}" for k, v in DEFAULT_OVERRIDES.items()}
    assert interpolate([1, 100], [0.2, 0.6], 10) == pytest.approx(0.4)  # halfway on a log axis
    assert interpolate([1, 100], [0.2, 0.6], 200) is None  # never extrapolated
    settings = EvalSettings(prompt_sets=("mtbench",))
    slow, fast = tmp_path / "slow", tmp_path / "fast"
    run_curve(
        slow,
        ["recipe=eagle3"],
        [10, 100],
        settings,
        runner=FakeTraining(),
        evaluate=fake_evaluate,
        say=lambda s: None,
    )
    run_curve(
        fast,
        ["recipe=eagle3", "drafter.ttt_steps=5"],
        [10, 100, 1000],
        settings,
        runner=FakeTraining(),
        evaluate=fake_evaluate,
        say=lambda s: None,
    )
    data = json.loads((fast / "curve.json").read_text())
    for p in data["points"]:  # the second recipe reaches each acceptance at a tenth of the CPU time
        p["train_cpu_seconds_total"] = p["tokens"] * 0.36 / 10
    (fast / "curve.json").write_text(json.dumps(data))
    data = json.loads((slow / "curve.json").read_text())
    for p in data["points"]:
        p["train_cpu_seconds_total"] = p["tokens"] * 0.36
    (slow / "curve.json").write_text(json.dumps(data))
    out = tmp_path / "compare"
    assert compare([slow, fast], out)["picked"] == str(fast)
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
    if shutil.which("make") is None:
        return
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
