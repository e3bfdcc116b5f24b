"""The export that served best: with a served-tau probe on, training keeps the export of the
validation pass whose served tau peaked (``export_best``) beside the last one, a resumed run
compares against the kept best, and ``validation.served_tau.keep_best=false`` keeps none. A
scripted probe stands in for the runtime's (the real probe: test_served_tau.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pattern_target import write_heldout_prompts
from test_served_tau import train_medusa

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> Path:
    return write_heldout_prompts(tmp_path_factory.mktemp("prompts") / "heldout.jsonl")


class Scripted:
    """A probe that serves the given taus in turn and keeps the weights it was shown at each
    call."""

    every = 1

    def __init__(self, taus: list[float]) -> None:
        self.taus, self.seen = list(taus), []

    def serves(self, method: str) -> bool:
        return True

    def __call__(self, export_dir):
        from safetensors.torch import load_file

        self.seen.append(load_file(str(Path(export_dir) / "model.safetensors")))
        return {"served_tau": self.taus[len(self.seen) - 1]}


def test_the_export_that_served_best_is_kept_beside_the_last(
    tmp_path, tiny_target_dir, tiny_data_file, heldout
):
    from safetensors.torch import load_file

    from draftsmith.distill.engine.best_export import BEST_EXPORT

    # passes at steps 1, 2, 3 and the final one at 3: the probe peaks at step 2 while training goes
    # on
    probe = Scripted([1.2, 1.9, 1.4, 1.4])
    summary = train_medusa(
        tiny_target_dir,
        tiny_data_file,
        heldout,
        tmp_path / "a",
        steps=3,
        probe=probe,
        overrides=("run.val_every=1",),
    )
    best = tmp_path / "a" / BEST_EXPORT
    assert summary["export_best"] == {
        "step": 2,
        "served_tau": 1.9,
        "tokens": summary["export_best"]["tokens"],
        "path": str(best),
    }
    config = json.loads((best / "config.json").read_text())
    assert config["training"]["steps"] == 2 and config["training"]["chosen_by"] == "val/served_tau"
    kept, last = (
        load_file(str(best / "model.safetensors")),
        load_file(str(tmp_path / "a" / "export" / "model.safetensors")),
    )
    assert all(torch.equal(kept[k], probe.seen[1][k]) for k in kept)  # the step-2 weights, exactly
    assert any(not torch.equal(kept[k], last[k]) for k in kept)  # not the last ones


def test_a_resumed_run_keeps_the_best_of_before_the_resume(
    tmp_path, tiny_target_dir, tiny_data_file, heldout
):
    from draftsmith.distill.engine.best_export import BEST_EXPORT

    # a resumed run compares against the kept best: a lower tau after the resume does not replace it
    run = ("run.val_every=1", "run.checkpoint_every=1")
    train_medusa(
        tiny_target_dir,
        tiny_data_file,
        heldout,
        tmp_path / "b",
        steps=2,
        probe=Scripted([1.2, 1.9, 1.9]),
        overrides=run,
    )
    again = train_medusa(
        tiny_target_dir,
        tiny_data_file,
        heldout,
        tmp_path / "b",
        steps=4,
        probe=Scripted([1.5, 1.7, 1.7]),
        overrides=run,
    )
    assert (
        again["steps"] == 4
        and again["export_best"]["step"] == 2
        and again["export_best"]["served_tau"] == 1.9
    )
    assert (
        json.loads((tmp_path / "b" / BEST_EXPORT / "config.json").read_text())["training"]["steps"]
        == 2
    )


def test_keep_best_false_keeps_no_best_export(tmp_path, tiny_target_dir, tiny_data_file, heldout):
    from draftsmith.distill.engine.best_export import BEST_EXPORT

    off = train_medusa(
        tiny_target_dir,
        tiny_data_file,
        heldout,
        tmp_path / "c",
        steps=2,
        probe=Scripted([2.0] * 3),
        overrides=("run.val_every=1", "validation.served_tau.keep_best=false"),
    )
    assert "export_best" not in off and not (tmp_path / "c" / BEST_EXPORT).exists()
