"""``logger=wandb`` offline (WANDB_MODE=offline, no network): the run is named after recipe +
overrides and stores the resolved config and the export's config.json."""

from __future__ import annotations

import importlib.util
import json

import pytest

from draftsmith.cli.training import compose_config
from draftsmith.distill.engine.trainer import train
from draftsmith.recipes import get_recipe

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(
        importlib.util.find_spec("wandb") is None, reason="wandb not installed (extra: wandb)"
    ),
]


def test_offline_wandb_run_has_name_config_and_export_config(
    tmp_path, tiny_target_dir, tiny_data_file, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    calls: list[dict] = []
    real_init = wandb.init

    def spy(
        *args, **kwargs
    ):  # what Lightning's WandbLogger hands to wandb.init, then the real init
        calls.append(kwargs)
        return real_init(*args, **kwargs)

    monkeypatch.setattr(wandb, "init", spy)
    run_dir = tmp_path / "run"
    cfg = compose_config(
        [
            "recipe=medusa",
            "logger=wandb",
            f"target.name_or_path={tiny_target_dir}",
            "target.dtype=fp32",
            f"data.spec={tiny_data_file}",
            "data.limit=null",
            "data.max_length=48",
            "data.batch_size=4",
            "trainer.max_steps=2",
            "run.final_eval_batches=0",
            "heads.num_heads=2",
        ]
    )
    summary = train(cfg, get_recipe("medusa"), run_dir, run_name="medusa-heads.num_heads=2")
    assert len(calls) == 1 and summary["export"]
    init = calls[0]
    assert (
        init["name"] == "medusa-heads.num_heads=2"
        and init["group"] == "medusa"
        and init["mode"] == "offline"
    )
    config = init["config"]  # the resolved config, stored with the run
    assert config["recipe"] == {"name": "medusa"} and config["heads"]["num_heads"] == 2
    assert (
        config["target"]["name_or_path"] == str(tiny_target_dir)
        and config["trainer"]["max_steps"] == 2
    )
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    # written offline, and finished (a sweep's next job gets its own)
    assert len(runs) == 1 and wandb.run is None
    exported = json.loads(
        (runs[0] / "files" / "export" / "config.json").read_text()
    )  # synced with the run
    assert exported["method"] == "medusa" and exported["architecture"]["num_heads"] == 2
