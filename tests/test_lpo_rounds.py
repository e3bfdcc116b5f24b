"""Iterated LPO end to end: round 1's rollouts train an adaptive-temperature controller, round 2
samples with it and trains on every round's pairs starting from round 1's head; the controller is
then served (its temperatures reach the loop, a sequence-level layer decides afresh per prompt) and
benched for speed (its overhead) and reward (against every fixed grid temperature)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from test_lpo_rollouts import REWARD, TEXTS, rows

from draftsmith.common.errors import DataError
from draftsmith.controllers.adaptive_temperature import AdaptiveTemperatureHead
from draftsmith.controllers.adaptive_temperature import TemperaturePolicy as Policy
from draftsmith.datagen.rollouts import RolloutError
from draftsmith.distill.data.preferences import read_pairs

pytestmark = pytest.mark.unit


def round_one_rollouts_and_controller(common: list[str], target_dir, tmp_path, capsys):
    """Round 1: bad grids are refused, rollouts are written, the controller trains on them; round 2
    samples with it. Returns round 1's training summary and its head."""
    from draftsmith.cli.training import compose_config
    from draftsmith.datagen.rollouts_command import main
    from draftsmith.distill.engine.trainer import train
    from draftsmith.recipes import get_recipe

    with pytest.raises(ValueError, match="grid is empty"):
        main([*common, "--grid", "", "--out", str(tmp_path / "bad")])
    with pytest.raises(RolloutError, match=">= 2"):
        main([*common, "--samples-per-prompt", "1", "--out", str(tmp_path / "bad")])
    main([*common, "--grid", "0,0.5,1", "--out", str(tmp_path / "r1")])
    assert json.loads(capsys.readouterr().out)["written"] == len(TEXTS)
    cfg = compose_config(
        [
            "recipe=adaptive_temperature",
            f"target.name_or_path={target_dir}",
            "target.dtype=fp32",
            f"data.spec={tmp_path / 'r1'}",
            "trainer.max_steps=2",
            "data.batch_size=2",
            "data.val_fraction=0",
            "run.final_eval_batches=0",
            "lpo.form=latent",
            "controller.width=8",
        ]
    )
    summary = train(cfg, get_recipe("adaptive_temperature"), tmp_path / "run")
    head, config = AdaptiveTemperatureHead.from_export(summary["export"])
    assert config["method"] == "adaptive_temperature" and head.config.grid == [0.0, 0.5, 1.0]
    assert config["inference"]["granularity"] == "token" and summary["steps"] == 2
    temps = Policy(head)(torch.randn(4, head.config.hidden_size))
    assert temps.shape == (4,) and set(temps.tolist()) <= {0.0, 0.5, 1.0}
    with pytest.raises(
        RolloutError, match="--granularity sequence differs from the controller's token"
    ):
        main(
            [
                *common,
                "--controller",
                summary["export"],
                "--granularity",
                "sequence",
                "--out",
                str(tmp_path / "r2"),
            ]
        )
    main(
        [*common, "--controller", summary["export"], "--out", str(tmp_path / "r2")]
    )  # round 2 samples with the head
    assert json.loads((tmp_path / "r2" / "meta.json").read_text())["controller"].endswith("export")
    assert len(rows(tmp_path / "r2")) == len(TEXTS)
    return summary, head


def round_two_trains_on_every_round(
    common: list[str], target_dir, tmp_path, export: str, head
) -> None:
    """Round 2 trains on every round's pairs (r1+r2), starting from round 1's head (lr 0: it must
    come out unchanged); rounds must share the target and the grid, and name each folder once."""
    import shutil

    from draftsmith.cli.training import compose_config
    from draftsmith.common.errors import ConfigError
    from draftsmith.datagen.rollouts_command import main
    from draftsmith.distill.data.preferences import read_pair_rounds
    from draftsmith.distill.engine.trainer import train
    from draftsmith.recipes import get_recipe

    joined = f"{tmp_path / 'r1'}+{tmp_path / 'r2'}"
    _, pairs = read_pair_rounds(joined)
    assert len(pairs) == len(read_pairs(tmp_path / "r1")[1]) + len(read_pairs(tmp_path / "r2")[1])
    round2 = [
        "recipe=adaptive_temperature",
        f"target.name_or_path={target_dir}",
        "target.dtype=fp32",
        f"data.spec={joined}",
        "trainer.max_steps=1",
        "data.batch_size=2",
        "data.val_fraction=0",
        "run.final_eval_batches=0",
        "controller.width=8",
        f"controller.init={export}",
    ]
    second = train(
        compose_config([*round2, "optim.lr=0"]),
        get_recipe("adaptive_temperature"),
        tmp_path / "run2",
    )
    after, _ = AdaptiveTemperatureHead.from_export(second["export"])
    # round 1 moved the zero-initialised output layer: a fresh head differs
    assert head.out.weight.abs().sum() > 0
    for name, weight in head.state_dict().items():
        torch.testing.assert_close(after.state_dict()[name], weight, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="controller.init .* has another width"):
        train(
            compose_config([*round2, "controller.width=4"]),
            get_recipe("adaptive_temperature"),
            tmp_path / "run3",
        )
    main([*common, "--grid", "0,1", "--out", str(tmp_path / "other_grid")])
    with pytest.raises(DataError, match="must share the target and the grid"):
        read_pair_rounds(f"{tmp_path / 'r1'}+{tmp_path / 'other_grid'}")
    with pytest.raises(DataError, match="names a rollout folder twice"):
        read_pair_rounds(f"{tmp_path / 'r1'}+{tmp_path / 'r1'}")
    shutil.copytree(
        tmp_path / "r1", tmp_path / "run+v2"
    )  # a '+' inside one folder's name is not two rounds
    assert len(read_pair_rounds(tmp_path / "run+v2")[1]) == len(read_pairs(tmp_path / "r1")[1])


def serving_and_benching_the_controller(target_dir, export: str) -> None:
    """generate/bench --controller load it on its target; the loop samples at the layer's
    temperatures, and the bench sees a slow layer's cost both in its timing and in its direct
    share."""
    from draftsmith.bench.controller import bench_controller
    from draftsmith.runtime.serving import load_runtime

    rt = load_runtime(None, str(target_dir), "fp32", controller=export)
    assert rt.speculative.temperature_policy is not None and rt.inference["controller"]["grid"] == [
        0.0,
        0.5,
        1.0,
    ]
    out = rt.speculative.generate([5, 9, 13], 6, generator=torch.Generator().manual_seed(0)).tokens
    assert len(out) == 6
    result = bench_controller(rt, [[5, 9, 13], [7, 7, 2]], 6)
    assert result["tokens_per_s_with_layer"] > 0 and 0.0 <= result["mean_chosen_temperature"] <= 1.0
    # replayed call by call
    assert result["layer_calls"] >= 2 * 6 and result["tokens_per_s_without_layer"] > 0
    low, high = result["overhead_ci95"]
    assert low <= high and 0 < result["layer_share"] < 1 and result["layer_ms_per_call"] > 0
    fast_layer = rt.speculative.temperature_policy

    # A layer that costs 15 ms a call: both the timing and the direct share must see it. 15 ms, not
    # 3, so that it outweighs a tiny-target step even on a loaded machine (3 ms read as 0.25
    # overhead beside a second test worker).
    def slow_layer(hidden):
        time.sleep(0.015)
        return fast_layer(hidden)

    slow_layer.reset = getattr(fast_layer, "reset", lambda: None)
    rt.speculative.temperature_policy = slow_layer
    slow = bench_controller(rt, [[5, 9, 13], [7, 7, 2]], 6)
    rt.speculative.temperature_policy = fast_layer
    assert slow["layer_ms_per_call"] >= 15 and slow["layer_share"] > result["layer_share"]
    assert slow["overhead"] > 0.3 and slow["overhead_ci95"][0] > 0


def sequence_layer_decides_afresh_per_prompt(target_dir, tmp_path, export: str) -> None:
    """A sequence-level layer served by the runtime decides afresh for every prompt (its reset
    reaches the loop)."""
    from draftsmith.export.format import read_export, write_export
    from draftsmith.runtime.serving import load_runtime

    seq_config, seq_state = read_export(export)
    seq_config["architecture"]["granularity"] = seq_config["inference"]["granularity"] = "sequence"
    g = torch.Generator().manual_seed(5)
    seq_state = {
        k: torch.randn(v.shape, generator=g) * 3 if k.endswith("weight") else torch.zeros(v.shape)
        for k, v in sorted(seq_state.items())
    }
    seq_export = write_export(tmp_path / "seq_export", seq_state, seq_config)

    def choices(prompts_in_order):
        served = load_runtime(None, str(target_dir), "fp32", controller=str(seq_export))
        picked = []
        for prompt in prompts_in_order:
            served.speculative.generate(prompt, 4, generator=torch.Generator().manual_seed(0))
            picked.append(int(served.speculative.temperature_policy.last_indices[0]))
        return picked

    candidates = [[5, 9, 13], [7, 7, 2], [11, 4], [2, 8, 8, 6], [9], [14, 3, 5]]
    alone = [choices([c])[0] for c in candidates]
    assert len(set(alone)) > 1  # the random head picks different temperatures for different prompts
    assert choices(candidates) == alone


def reward_bench_of_the_controller(target_dir, tmp_path, prompts, export: str) -> None:
    """The reward bench: every fixed grid temperature and the layer on the task, then the layer's
    overhead."""
    from draftsmith.cli import main as cli_main

    assert (
        cli_main(
            [
                "bench",
                "--controller",
                export,
                "--target",
                str(target_dir),
                "--prompts",
                str(prompts),
                "--reward",
                REWARD,
                "--samples-per-prompt",
                "2",
                "--max-new-tokens",
                "6",
                "--overhead-prompts",
                "2",
                "--dtype",
                "fp32",
                "--out",
                str(tmp_path / "rb"),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "rb" / "reward_eval.json").read_text())
    assert list(report["table"]) == ["T=0", "T=0.5", "T=1", "adaptive-token"] and report[
        "prompts"
    ] == len(TEXTS)
    assert report["overhead"]["adaptive-token"]["layer_calls"] > 0
    assert (
        (tmp_path / "rb" / "reward_eval.md").read_text().startswith("| condition | mixed set | k |")
    )


@pytest.mark.e2e  # two rounds of rollouts and controller training, end to end
def test_two_rounds_rollouts_train_rollouts_with_the_controller(tiny_target_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t, "kind": "k"}) + "\n" for t in TEXTS))
    common = [
        "--target",
        str(tiny_target_dir),
        "--prompts",
        str(prompts),
        "--reward",
        REWARD,
        "--max-new-tokens",
        "6",
        "--samples-per-prompt",
        "3",
        "--no-progress",
    ]
    summary, head = round_one_rollouts_and_controller(common, tiny_target_dir, tmp_path, capsys)
    round_two_trains_on_every_round(common, tiny_target_dir, tmp_path, summary["export"], head)
    serving_and_benching_the_controller(tiny_target_dir, summary["export"])
    sequence_layer_decides_afresh_per_prompt(tiny_target_dir, tmp_path, summary["export"])
    reward_bench_of_the_controller(tiny_target_dir, tmp_path, prompts, summary["export"])
