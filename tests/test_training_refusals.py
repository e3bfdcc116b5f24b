"""Training refuses nonsense with one actionable line: bad optimizer values, missing or damaged
targets, binary or missing data, unknown ``+key`` overrides and rollout prompts longer than
data.max_length (runs that score no position: test_training_scores_nothing.py; Ctrl-C:
test_training_interrupts.py).
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_tiny_llama
from omegaconf import OmegaConf

from draftsmith.cli.training import compose_config
from draftsmith.common.errors import ConfigError, DataError, DataFileNotFoundError
from draftsmith.distill.target.frozen import Target

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def tiny_overrides(target_dir: Path, data_file: Path, *more: str) -> list[str]:
    return [
        f"target.name_or_path={target_dir}",
        "target.dtype=fp32",
        f"data.spec={data_file}",
        "data.limit=null",
        "data.max_length=48",
        "data.batch_size=4",
        "data.val_fraction=0.1",
        "run.final_eval_batches=1",
        "run.checkpoint_every=1000",
        "logger=csv",
        *more,
    ]


def run_train_inprocess(overrides: list[str], run_dir: Path):
    from draftsmith import recipes
    from draftsmith.distill.engine.trainer import train

    cfg = compose_config(overrides)
    return train(cfg, recipes.get_recipe(cfg.recipe.name), run_dir)


def train_main(argv: list[str], tmp_path: Path, monkeypatch, env: dict | None = None) -> int | None:
    """train.py as a script, in-process; its exit status."""
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "train.py",
            *argv,
            f"hydra.run.dir={tmp_path}",
            "hydra.output_subdir=null",
            "hydra/job_logging=none",
            "hydra/hydra_logging=none",
        ],
    )
    for key in ("HYDRA_FULL_ERROR", "DRAFTSMITH_DEBUG"):
        monkeypatch.delenv(key, raising=False)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as ended:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    return ended.value.code


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


# ------------------------------------------------------------------------- one actionable line each


def test_a_learning_rate_that_is_not_positive_is_refused_before_loading():
    from draftsmith import recipes
    from draftsmith.distill.engine.trainer import check_config

    medusa = recipes.get_recipe("medusa")
    for bad, match in (
        ("optim.lr=-1e-3", r"optim\.lr=-0\.001 is out of range: allowed >= 0"),
        ("optim.lr=nan", r"optim\.lr=nan is out of range: allowed >= 0"),
        ("optim.lr=inf", r"optim\.lr=inf is out of range: allowed >= 0"),
        ("optim.weight_decay=-1", r"optim\.weight_decay=-1\.0 is out of range: allowed >= 0"),
        (
            "optim.betas=[0.9,1.5]",
            r"optim\.betas=\[0\.9, 1\.5\] is out of range: allowed >= 0 and < 1 " r"and 2 values",
        ),
    ):
        with pytest.raises(ConfigError, match=match):
            check_config(compose_config(["recipe=medusa", bad]), medusa)


@pytest.mark.e2e  # a train.py subprocess: the exit status and stderr a user sees
def test_train_py_negative_lr_is_one_line_and_exit_1(tmp_path, tiny_target_dir, tiny_data_file):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "recipe=medusa",
            f"target={tiny_target_dir}",
            f"data={tiny_data_file}",
            "optim.lr=-1e-3",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: optim.lr=-0.001 is out of range: allowed >= 0"
    ), proc.stderr[-3000:]


def test_missing_or_damaged_targets_are_named_in_one_line(tmp_path, tiny_target_dir):
    import shutil

    with pytest.raises(
        ConfigError,
        match=r"^target\.name_or_path=/nonexistent/model: does not exist; point target=",
    ):
        Target.load("/nonexistent/model", "fp32")
    bad_config = tmp_path / "bad_config"
    shutil.copytree(tiny_target_dir, bad_config)
    (bad_config / "config.json").write_text('{"model_type": "llama", oops')
    with pytest.raises(
        ConfigError, match=rf"target file {bad_config}/config\.json is not valid JSON"
    ):
        Target.load(str(bad_config), "fp32")
    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_target_dir, truncated)
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(
        ConfigError,
        match=rf"target file {truncated}/model\.safetensors is damaged: it is truncated",
    ):
        Target.load(str(truncated), "fp32")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny_target_dir, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=rf"target folder {no_weights}: .*model\.safetensors"):
        Target.load(str(no_weights), "fp32")


def test_train_py_reports_a_missing_target_as_one_line(
    tmp_path, monkeypatch, capsys, tiny_data_file
):
    assert (
        train_main(
            ["recipe=medusa", "target.name_or_path=/nonexistent", f"data.spec={tiny_data_file}"],
            tmp_path,
            monkeypatch,
        )
        == 1
    )
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith(
        "error: target.name_or_path=/nonexistent: does not exist"
    ), lines


def test_binary_and_missing_data_are_named(tmp_path):
    from draftsmith.distill.data.conversations import load_conversations

    binary = tmp_path / "weights.jsonl"
    binary.write_bytes(bytes(range(256)) * 16)
    with pytest.raises(DataError, match=rf"data file {binary} is binary, not JSON text"):
        load_conversations(str(binary))
    parquet = tmp_path / "table.jsonl"
    parquet.write_bytes(b"PAR1" + bytes(range(256)))
    with pytest.raises(DataError, match=r"it is a parquet file: rename it to \.parquet"):
        load_conversations(str(parquet))
    late = tmp_path / "late.jsonl"  # valid first lines, then bytes that are not UTF-8
    late.write_bytes(b'{"conversations": []}\n' * 300 + b"\xff\xfe\xfd\n")
    with pytest.raises(DataError, match=rf"data file {late} is not UTF-8 text"):
        load_conversations(str(late))
    missing = tmp_path / "no_such_chats"
    with pytest.raises(DataFileNotFoundError, match=rf"^data path {missing} does not exist"):
        load_conversations(str(missing))
    with pytest.raises(DataFileNotFoundError, match="does not exist"):
        load_conversations("./no_such_folder_here")


def test_unknown_plus_keys_are_refused_by_the_schema_with_close_matches(
    tmp_path, monkeypatch, capsys
):
    from draftsmith.distill.config.checks import schema_problems

    cfg = compose_config(
        ["recipe=medusa", "+heads.num_head=4"]
    )  # Hydra's `+` gets past struct mode
    assert schema_problems(cfg) == [
        "heads.num_head is not a key of recipe=medusa; did you mean heads.num_heads? "
        "(python train.py recipe=medusa --help lists its keys with their types, "
        "defaults and docs)"
    ]
    cfg = compose_config(["recipe=eagle", "+drafter.noise_std=0.2", "+trainer.fsdp_opts=1"])
    problems = schema_problems(
        cfg
    )  # noise_std: an older key eagle still reads, declared in its schema
    assert len(problems) == 1 and problems[0].startswith(
        "trainer.fsdp_opts is not a key of recipe=eagle"
    ), problems

    from draftsmith.distill.engine import trainer

    monkeypatch.setattr(trainer, "train", lambda *a, **k: pytest.fail("training must not start"))
    for typo in ("+heads.num_head=4", "heads.num_head=4"):
        assert train_main(["recipe=medusa", typo], tmp_path, monkeypatch) == 1
        lines = error_lines(capsys.readouterr().err)
        assert len(lines) == 1 and lines[0].startswith(
            "error: heads.num_head is not a key of recipe=medusa; did you mean heads.num_heads?"
        ), lines


def test_medusa_draft_vocab_warning_names_the_heads_key(
    tmp_path, monkeypatch, caplog, tiny_tokenizer, tiny_data_file
):
    from draftsmith.recipes.medusa.objective import medusa_draft_ids

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    cfg = compose_config(
        [
            "recipe=medusa",
            f"data.spec={tiny_data_file}",
            "data.max_length=48",
            "heads.draft_vocab_size=100",
        ]
    )
    target = Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")
    with caplog.at_level(logging.WARNING):
        ids = medusa_draft_ids(cfg, target)
    assert ids.numel() == 100
    warned = [
        r.getMessage() for r in caplog.records if "distinct assistant tokens" in r.getMessage()
    ]
    assert (
        len(warned) == 1
        and "lower heads.draft_vocab_size" in warned[0]
        and "drafter." not in warned[0]
    ), warned


# ------------------------------------------------------------- rollouts longer than data.max_length


def test_rollout_prompts_longer_than_max_length_are_skipped_and_reported(tmp_path, caplog):
    from draftsmith.datagen.rollouts_command import DEFAULT_TRAIN_MAX_LENGTH, length_warning
    from draftsmith.distill.data.preferences import PreferenceDataModule

    assert DEFAULT_TRAIN_MAX_LENGTH == OmegaConf.load(ROOT / "conf/data/sharegpt.yaml").max_length
    folder = tmp_path / "rollouts"
    folder.mkdir()
    (folder / "meta.json").write_text(
        json.dumps(
            {"grid": [0.0, 1.0], "granularity": "sequence", "max_new_tokens": 8, "target": "tiny"}
        )
    )
    sample = {"tokens": [7, 8, 9], "temps": [0, 0, 0], "reward": 1.0}
    rows = [
        {
            "prompt_index": i,
            "kind": "k",
            "prompt_ids": list(range(5, 5 + n)),
            "samples": [sample, {**sample, "reward": 0.0}],
            "chosen": 0,
            "rejected": 1,
        }
        for i, n in enumerate([10, 30, 12, 40, 11, 9])
    ]
    (folder / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    data = PreferenceDataModule(folder, batch_size=2, max_length=24, pad_id=0, val_fraction=0.2)
    with caplog.at_level(logging.WARNING, logger="draftsmith.distill.data.preferences"):
        data.setup("fit")
    assert len(data.train_set) + len(data.val_set) == 4
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and warned[0].startswith(
        f"2 of 6 rollout pair(s) of {folder} have a prompt of "
        "data.max_length=24 tokens or more (the longest 40)"
    ), warned
    assert "data.max_length=48 keeps them all" in warned[0]
    next(iter(data.train_dataloader()))  # the kept pairs batch fine

    with pytest.raises(
        DataError,
        match=r"6 of 6 rollout pair\(s\).*nothing left to train on; set " r"data\.max_length=48",
    ):
        PreferenceDataModule(folder, batch_size=2, max_length=9, pad_id=0).setup("fit")

    assert length_warning([10, 20], 8) is None
    text = length_warning([268, 100, 250], 64)
    assert (
        text.startswith("warning: 1 of 3 prompt(s) have 256+ tokens (the longest 268)")
        and "1 prompt(s) + --max-new-tokens 64 exceed it" in text
        and "data.max_length=332" in text
    ), text


def test_rollouts_warn_about_long_prompts_before_sampling(
    tmp_path, monkeypatch, capsys, tiny_target_dir
):
    from draftsmith.datagen import rollouts_command

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"text": " ".join(["hello world"] * 140)}) + "\n")

    monkeypatch.setattr(rollouts_command, "write_rollouts", lambda *a, **k: {"stopped": True})
    assert (
        rollouts_command.main(
            [
                "--target",
                str(tiny_target_dir),
                "--prompts",
                str(prompts),
                "--out",
                str(tmp_path / "out"),
                "--no-progress",
                "--max-new-tokens",
                "4",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "warning: 1 of 1 prompt(s) have 256+ tokens" in err and "training skips them" in err, err
