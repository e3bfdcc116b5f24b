"""Resumes refused before anything loads, naming what changed: optimiser or data keys (and
``run.resume=changed``, which accepts them and trains at the new rate), another target (a copy of
the same one is no change), and a run folder that is a file or read-only. Tiny in-process target,
in-process ``train``."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from test_resume_faults import step_files, tiny_cfg

from draftsmith.distill.engine.trainer import train
from draftsmith.recipes import get_recipe

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _data_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path_factory.getbasetemp() / "draftsmith-cache"))


def test_a_resume_that_changes_optimiser_or_data_keys_is_refused_naming_them(
    tmp_path, tiny_target_dir, tiny_data_file
):
    from draftsmith.common.errors import ConfigError

    run_dir = tmp_path / "run"
    constant = ("optim.scheduler=constant", "optim.lr=0.001")
    train(tiny_cfg(tiny_target_dir, tiny_data_file, *constant), get_recipe("medusa"), run_dir)
    other_data = tmp_path / "other.jsonl"
    other_data.write_text(tiny_data_file.read_text().replace("answer", "question"))
    cases = {
        ("optim.scheduler=constant", "optim.lr=0.0003"): "optim.lr 0.001 -> 0.0003",
        (*constant, f"data={other_data}"): f"data.spec {tiny_data_file} -> {other_data}",
        (*constant, "data.max_length=40"): "data.max_length 48 -> 40",
        (*constant, "run.seed=7"): "run.seed 0 -> 7",
    }
    for overrides, named in cases.items():
        with pytest.raises(ConfigError) as refused:
            train(
                tiny_cfg(tiny_target_dir, tiny_data_file, *overrides, "trainer.max_steps=6"),
                get_recipe("medusa"),
                run_dir,
            )
        message = str(refused.value)
        assert (
            named in message
            and "hydra.run.dir=NEW_DIR" in message
            and "run.resume=changed" in message
        ), message
    assert step_files(run_dir) == ["step2.ckpt", "step4.ckpt"]  # nothing trained
    # What may change: the run's length, the per-device batch (the global batch is kept), the
    # loader's workers.
    extended = train(
        tiny_cfg(
            tiny_target_dir, tiny_data_file, *constant, "trainer.max_steps=5", "data.num_workers=0"
        ),
        get_recipe("medusa"),
        run_dir,
    )
    assert extended["steps"] == 5


def test_run_resume_changed_trains_at_the_new_rate(tmp_path, tiny_target_dir, tiny_data_file):
    run_dir = tmp_path / "run"
    train(
        tiny_cfg(tiny_target_dir, tiny_data_file, "optim.scheduler=constant", "optim.lr=0.001"),
        get_recipe("medusa"),
        run_dir,
    )
    train(
        tiny_cfg(
            tiny_target_dir,
            tiny_data_file,
            "optim.scheduler=constant",
            "optim.lr=0.0003",
            "optim.weight_decay=0.05",
            "trainer.max_steps=6",
            "run.resume=changed",
        ),
        get_recipe("medusa"),
        run_dir,
    )
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 6
    groups = saved["optimizer_states"][0]["param_groups"]
    assert {g["lr"] for g in groups} == {0.0003} and {g["weight_decay"] for g in groups} == {0.05}
    assert saved["lr_schedulers"][0]["base_lrs"] == [0.0003] * len(groups)
    # the next resume compares against the new value
    assert saved["draftsmith"]["config"]["optim"]["lr"] == 0.0003


def test_a_resume_against_another_target_is_refused_and_a_copy_of_the_same_one_is_not(
    tmp_path, tiny_target_dir, tiny_data_file, tiny_tokenizer, caplog
):
    from conftest import build_tiny_llama

    from draftsmith.common.errors import ConfigError

    run_dir = tmp_path / "run"
    train(tiny_cfg(tiny_target_dir, tiny_data_file), get_recipe("medusa"), run_dir)
    # the same shapes, other weights: it used to resume without a word
    other = tmp_path / "other_target"
    build_tiny_llama(len(tiny_tokenizer), seed=5).save_pretrained(other)
    tiny_tokenizer.save_pretrained(other)
    with pytest.raises(
        ConfigError, match=r"trained against the target .* is another model \(tokenizer and LM head"
    ):
        train(tiny_cfg(other, tiny_data_file, "trainer.max_steps=6"), get_recipe("medusa"), run_dir)
    copy = shutil.copytree(tiny_target_dir, tmp_path / "moved_target")
    assert (
        train(tiny_cfg(copy, tiny_data_file, "trainer.max_steps=5"), get_recipe("medusa"), run_dir)[
            "steps"
        ]
        == 5
    )
    with caplog.at_level(
        logging.WARNING
    ):  # a max_steps at or below the checkpoint's step says it trains nothing
        assert (
            train(
                tiny_cfg(copy, tiny_data_file, "trainer.max_steps=3"), get_recipe("medusa"), run_dir
            )["steps"]
            == 5
        )
    assert "is at step 5 and trainer.max_steps=3: nothing is left to train" in caplog.text


def test_a_run_folder_that_is_a_file_or_read_only_is_refused_before_anything_loads(
    tmp_path, tiny_target_dir, tiny_data_file
):
    import subprocess

    from draftsmith.common.errors import ConfigError

    a_file = tmp_path / "run.txt"
    a_file.write_text("the user's file")
    with pytest.raises(ConfigError, match=r"run.txt is a file, not a folder: nothing was trained"):
        train(tiny_cfg(tiny_target_dir, tiny_data_file), get_recipe("medusa"), a_file)
    with pytest.raises(ConfigError, match=r"cannot be made: .*run.txt is a file"):
        train(tiny_cfg(tiny_target_dir, tiny_data_file), get_recipe("medusa"), a_file / "run")
    assert a_file.read_text() == "the user's file"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"checkpoints is a file, not a folder"):
        train(tiny_cfg(tiny_target_dir, tiny_data_file), get_recipe("medusa"), tmp_path / "run")
    mount = tmp_path / "ro"
    mount.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,ro", "tmpfs", str(mount)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    # resuming in a run folder on a read-only file system used to fail after the target loaded, in a
    # traceback
    try:
        with pytest.raises(
            ConfigError, match=r"is on a read-only file system, and a run writes its checkpoints"
        ):
            train(tiny_cfg(tiny_target_dir, tiny_data_file), get_recipe("medusa"), mount / "run")
    finally:
        subprocess.run(["umount", str(mount)], check=False)
