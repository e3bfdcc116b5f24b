"""Warm start through ``train.py`` on a tiny target: step-0 weights are the export's, the LR warms
up again on a fresh optimizer, the export's lineage accumulates steps and tokens and continues the
data order, and a resumed warm-started run keeps its record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_train import run_train as _run_train
from test_train import tiny_overrides

from draftsmith.export.format import read_export

pytestmark = pytest.mark.e2e


def run_train(*overrides: str):
    """``train.py`` as a user runs it, with room for a loaded machine (each run is a fresh Python +
    Lightning)."""
    return _run_train(*overrides, timeout=900)


def warm_overrides(max_steps: int, init_from: Path) -> list[str]:
    """The warm run's overrides: a 4-step warm-up, a checkpoint kept at every step."""
    return [
        f"trainer.max_steps={max_steps}",
        "optim.warmup_steps=4",
        "run.checkpoint_every=1",
        "run.keep_checkpoints=5",
        f"run.init_from={init_from}",
    ]


def check_the_lineage_continues(source: dict, config: dict) -> None:
    """A one-step run warm-started from a 4-step export: its lineage adds its step and tokens to
    the export's and continues the same data order."""
    lineage = config["training"]["lineage"]
    assert lineage["steps_total"] == 5 and lineage["order_steps"] == 5  # same data order: continued
    assert lineage["tokens_total"] == source["training"]["tokens"] + config["training"]["tokens"]
    assert lineage["runs"][-1]["data_order_continued"] is True and len(lineage["runs"]) == 2


def check_a_fresh_warmup(warm: Path) -> None:
    """The warm run's step-1 checkpoint: the LR warms up again on a fresh AdamW, and the run
    recorded the export's data order."""
    ckpt = torch.load(warm / "checkpoints" / "step1.ckpt", weights_only=True, map_location="cpu")
    base = float(ckpt["hyper_parameters"]["optim"]["lr"])
    group = ckpt["optimizer_states"][0]["param_groups"][0]
    # warming up again: step 1 of a 4-step warm-up
    assert group["lr"] == pytest.approx(base * 2 / 4)
    # a fresh AdamW
    assert all(int(s["step"]) == 1 for s in ckpt["optimizer_states"][0]["state"].values())
    assert json.loads((warm / "warm_start.json").read_text())["order_steps"] == 4


def test_a_warm_start_begins_at_the_exports_weights_with_a_fresh_warmup(
    tmp_path, tiny_target_dir, tiny_data_file
):
    assets = (tiny_target_dir, tiny_data_file)
    first = tmp_path / "first"
    run_train(*tiny_overrides(*assets, first, "trainer.max_steps=4", "optim.scheduler=constant"))
    source, weights = read_export(first / "export")
    assert (
        source["training"]["lineage"]["order_steps"] == 4
        and source["training"]["lineage"]["runs"][0]["sittings"]
    )

    frozen = tmp_path / "frozen"  # lr 0: the weights it exports are the ones it started from
    run_train(
        *tiny_overrides(
            *assets,
            frozen,
            "trainer.max_steps=1",
            "optim.lr=0",
            f"run.init_from={first / 'export'}",
        )
    )
    config, again = read_export(frozen / "export")
    assert weights.keys() == again.keys() and all(
        torch.equal(weights[k], again[k]) for k in weights
    )
    check_the_lineage_continues(source, config)

    warm = tmp_path / "warm"
    run_train(*tiny_overrides(*assets, warm, *warm_overrides(2, first / "export")))
    check_a_fresh_warmup(warm)
    # a resume reads no export
    resumed = run_train(
        *tiny_overrides(*assets, warm, *warm_overrides(3, tmp_path / "nothing-here"))
    )
    assert resumed.returncode == 0
    lineage = read_export(warm / "export")[0]["training"]["lineage"]
    assert lineage["order_steps"] == 4 + 3 and lineage["runs"][-1]["sittings"] == 2
    sittings = json.loads((warm / "sittings.json").read_text())
    # the second sitting resumed at step 2
    assert [s["steps"] for s in sittings] == [[0, 2], [2, 3]]
