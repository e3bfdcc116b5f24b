"""``bench --controller`` on a reward task: paired conditions (a layer that always picks T equals
fixed T draw for draw), the summary's statistics on hand-made rows, the per-condition cache, and the
CLI's refusals.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_llama

from draftsmith.common.chat import encode_chat
from draftsmith.controllers.adaptive_temperature import (
    AdaptiveTemperatureConfig,
    AdaptiveTemperatureHead,
)
from draftsmith.evals import reward_eval
from draftsmith.evals.reward_eval import bootstrap_ci, evaluate, reward_table, summarize

pytestmark = pytest.mark.unit

GRID = [0.0, 1.0]
TEXTS = ["hello world", "what is the answer", "please explain why", "write some code"]


def word_count(prompt: dict, response: str) -> float:
    return float(len(response.split()))


@pytest.fixture(scope="module")
def setup(tiny_tokenizer):
    model = build_tiny_llama(len(tiny_tokenizer), seed=5)
    records = [
        {
            "id": str(i),
            "kind": "a" if i % 2 else "b",
            "text": t,
            "answer": None,
            "ids": encode_chat(tiny_tokenizer, t),
        }
        for i, t in enumerate(TEXTS)
    ]
    return model, records, lambda ids: tiny_tokenizer.decode(ids, skip_special_tokens=True)


def always(index: int, granularity: str, hidden_size: int) -> AdaptiveTemperatureHead:
    head = AdaptiveTemperatureHead(
        AdaptiveTemperatureConfig(hidden_size=hidden_size, grid=GRID, granularity=granularity)
    )
    with torch.no_grad():
        head.out.bias[index] = 10.0
    return head.eval()


def run(setup, layers, out=None, seed=3):
    model, records, decode = setup
    settings = {"seed": seed}
    return evaluate(
        model,
        records,
        layers,
        GRID,
        word_count,
        "words",
        decode,
        3,
        8,
        (3,),
        seed,
        out,
        settings,
        progress=False,
    )


@pytest.mark.parametrize("granularity", ["sequence", "token"])
def test_a_layer_that_always_picks_t_is_fixed_t_draw_for_draw(setup, granularity):
    h = setup[0].config.hidden_size
    result = run(
        setup, {"hot": (always(1, granularity, h), "a"), "cold": (always(0, granularity, h), "b")}
    )
    table = result["table"]
    # common random numbers, exactly
    assert table["hot"] == table["T=1"] and table["cold"] == table["T=0"]
    assert (
        table["hot"]["a"]["mean_temperature"] == 1.0
        and table["cold"]["b"]["mean_temperature"] == 0.0
    )
    diffs = result["layer_vs_fixed"]["hot"]
    assert diffs["T=1"]["mean"] == 0.0 and not diffs["beats_every_fixed"]


def test_summary_statistics_on_hand_made_rows():
    def rows(values):
        return [
            {"id": str(i), "kind": "x" if i < 3 else "y", "rewards": [v, v], "temperature": 0.5}
            for i, v in enumerate(values)
        ]

    conditions = {
        "T=0": rows([1, 1, 1, 0, 0, 0]),
        "T=1": rows([0, 0, 0, 1, 1, 1]),
        "layer": rows([1, 1, 1, 1, 1, 0]),
    }
    s = summarize(conditions, ["layer"])
    assert s["table"]["layer"]["all"]["mean"] == pytest.approx(5 / 6)
    assert s["table"]["T=0"]["x"]["mean"] == 1.0 and s["table"]["T=0"]["y"]["mean"] == 0.0
    assert s["best_fixed_by_kind"] == {"x": "T=0", "y": "T=1"}
    assert s["layer_vs_fixed"]["layer"]["T=0"]["mean"] == pytest.approx(2 / 6)
    assert s["layer_vs_fixed"]["layer"]["beats_every_fixed"]
    assert "layer minus each fixed temperature" in reward_table(s)
    lo, hi = bootstrap_ci([0.25] * 5)
    assert lo == hi == 0.25
    lo, hi = bootstrap_ci([0.0, 1.0] * 20)
    assert 0.3 < lo < 0.5 < hi < 0.7
    with pytest.raises(ValueError, match="other prompts"):
        summarize({"T=0": rows([1] * 6), "T=1": rows([1] * 5)}, [])


def test_conditions_are_cached_and_resampled_when_the_layer_changes(setup, tmp_path, monkeypatch):
    h = setup[0].config.hidden_size
    first = run(setup, {"layer": (always(1, "sequence", h), "v1")}, tmp_path)
    assert first["sampled"] == ["T=0", "T=1", "layer"]

    def refuse(*args, **kwargs):
        raise AssertionError("sampled a cached condition again")

    monkeypatch.setattr(reward_eval, "sample_group", refuse)
    again = run(setup, {"layer": (always(1, "sequence", h), "v1")}, tmp_path)
    assert again["sampled"] == [] and again["table"] == first["table"]
    monkeypatch.undo()
    changed = run(
        setup, {"layer": (always(0, "sequence", h), "v2")}, tmp_path
    )  # retrained weights: new fingerprint
    assert changed["sampled"] == ["layer"] and changed["table"]["layer"] == first["table"]["T=0"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["bench", "--controller", "a,b", "--prompts", "mtbench"],
            "are compared by the reward bench",
        ),
        (
            ["bench", "--controller", "a", "--drafter", "d", "--prompts", "embedded:heldout"],
            "--drafter belongs to `draftsmith bench controller`",
        ),
        (["bench", "--prompts", "embedded:heldout", "--grid", "0,-1"], "has one that must be >= 0"),
    ],
)
def test_bench_refuses_mixed_modes(argv, message, capsys):
    from draftsmith.cli import main

    assert main(argv) != 0
    assert message in capsys.readouterr().err


def test_the_embedded_task_splits_are_disjoint_and_the_first_forty_are_stable():
    from draftsmith.datagen.mixed_task import mixed_prompts

    train, held = mixed_prompts("train"), mixed_prompts("heldout")
    assert (len(train), len(held)) == (192, 48)
    assert {p["kind"] for p in held} == {"arithmetic", "copy", "continue"}
    open_texts = {
        p["text"] for p in train if p["kind"] != "arithmetic"
    }  # arithmetic has only 81 possible prompts
    assert not open_texts & {p["text"] for p in held}
    assert train[:96] == mixed_prompts("train", 40) and held[:24] == mixed_prompts("heldout", 40)
    with pytest.raises(ValueError, match="per_kind must be"):
        mixed_prompts("train", 81)
