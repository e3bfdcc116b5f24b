"""Typed recipe configs (issue 41 item 3, issue 40's training parts): every recipe has a dataclass
schema in Hydra's ConfigStore with a doc per key; misspelt keys (with or without `+`) and
out-of-range values are one `error:` line naming the close match or the allowed range, before
anything loads; `--help` lists the recipes and a recipe's keys; an empty data folder gets one line.
A run folder holding another model's checkpoint: tests/test_config_resume.py; the DFlash served
cut: tests/test_dflash_cut.py."""

from __future__ import annotations

import dataclasses
import runpy
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from draftsmith.cli.training import compose_config
from draftsmith.common.errors import ConfigError, DataError
from draftsmith.recipes import RECIPES as REGISTERED

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(REGISTERED)


def run_train_py(
    argv: list[str], tmp_path: Path, monkeypatch, capsys
) -> tuple[int | None, str, str]:
    """``python train.py ARGV`` in-process with training replaced by a failure: (exit status,
    stdout, stderr)."""
    from draftsmith.distill.engine import trainer

    monkeypatch.setattr(trainer, "train", lambda *a, **k: pytest.fail("training must not start"))
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
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as ended:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    out = capsys.readouterr()
    return ended.value.code, out.out, out.err


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


# --------------------------------------------------------------------------- the schemas themselves
@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_composes_into_its_own_schema_with_a_doc_per_key(name):
    from draftsmith.distill.config.checks import schema_fields, schema_problems

    schema = REGISTERED[name].schema
    cfg = compose_config([f"recipe={name}"])
    assert OmegaConf.get_type(cfg) is schema
    assert schema_problems(cfg) == []
    leaves = [(path, f) for path, f, group in schema_fields(schema) if group is None]
    undocumented = [path for path, f in leaves if not f.metadata.get("doc")]
    assert undocumented == []


def test_a_wrong_type_and_an_unknown_key_are_refused_by_the_config_system():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(
        ConfigCompositionException
    ):  # Hydra's struct mode: the schema has no heads.num_head
        compose_config(["recipe=medusa", "heads.num_head=4"])
    with pytest.raises(ConfigCompositionException):  # typed: an int key refuses text
        compose_config(["recipe=medusa", "heads.num_heads=four"])


@pytest.mark.parametrize("typo", ["heads.num_head=4", "+heads.num_head=4"])
def test_a_misspelt_key_is_one_line_with_the_close_match(typo, tmp_path, monkeypatch, capsys):
    code, _, err = run_train_py(["recipe=medusa", typo], tmp_path, monkeypatch, capsys)
    lines = error_lines(err)
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith(
        "error: heads.num_head is not a key of recipe=medusa; did you mean heads.num_heads?"
    )
    assert "Traceback" not in err and "To append to your config use" not in err


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("data.limit=0", "error: data.limit=0 is out of range: allowed >= 1, or null (all)"),
        ("data.limit=-1", "error: data.limit=-1 is out of range: allowed >= 1, or null (all)"),
        ("data.batch_size=0", "error: data.batch_size=0 is out of range: allowed >= 1"),
        ("optim.lr=-0.5", "error: optim.lr=-0.5 is out of range: allowed >= 0"),
        (
            "optim.scheduler=step",
            "error: optim.scheduler=step is out of range: allowed one of constant, linear, cosine",
        ),
        ("heads.decay=1.5", "error: heads.decay=1.5 is out of range: allowed > 0 and <= 1"),
        (
            "loss.acceptance=kl",
            "error: loss.acceptance=kl is out of range: allowed one of none, hybrid, nla, tv",
        ),
        ("loss.acceptance_eta=0", "error: loss.acceptance_eta=0.0 is out of range: allowed > 0"),
    ],
)
def test_out_of_range_values_are_one_line_before_anything_loads(
    override, expected, tmp_path, monkeypatch, capsys
):
    code, _, err = run_train_py(["recipe=medusa", override], tmp_path, monkeypatch, capsys)
    lines = error_lines(err)
    assert code == 1 and len(lines) == 1 and lines[0].startswith(expected), err


def test_a_sweep_is_checked_job_by_job_before_hydra_starts(tmp_path, monkeypatch, capsys):
    from draftsmith.cli.train_command_line import sweep_jobs

    assert sweep_jobs(
        ["recipe=medusa,hydra", "drafter.target_layers=[1,2,3]", "optim.lr=1e-3,2e-3"]
    ) == [
        ["recipe=medusa", "drafter.target_layers=[1,2,3]", "optim.lr=1e-3"],
        ["recipe=hydra", "drafter.target_layers=[1,2,3]", "optim.lr=1e-3"],
        ["recipe=medusa", "drafter.target_layers=[1,2,3]", "optim.lr=2e-3"],
    ]
    assert sweep_jobs(["optim.lr=range(1,3)"]) is None  # Hydra's own sweep syntax: Hydra expands it
    for sweep, expected in (
        (["heads.num_heads=2,0"], "error: heads.num_heads=0 is out of range: allowed >= 1"),
        (["heads.num_head=2,3"], "error: heads.num_head is not a key of recipe=medusa; did you"),
    ):
        code, _, err = run_train_py(["-m", "recipe=medusa", *sweep], tmp_path, monkeypatch, capsys)
        lines = error_lines(err)
        assert code == 1 and len(lines) == 1 and lines[0].startswith(expected), err


def test_bench_train_refuses_a_typo_in_one_line_before_loading(capsys, monkeypatch):
    from draftsmith.cli.training import _cmd_bench_train
    from draftsmith.distill.engine import bench_train

    monkeypatch.setattr(bench_train, "bench_train", lambda *a, **k: pytest.fail("must not start"))
    assert _cmd_bench_train(["recipe=medusa", "heads.num_head=2", "--steps", "1"]) == 1
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith(
        "draftsmith bench-train: error: heads.num_head is not a key of "
        "recipe=medusa; did you mean heads.num_heads?"
    ), lines


def test_null_limit_means_all_and_passes():
    from draftsmith.distill.config.checks import schema_problems

    assert schema_problems(compose_config(["recipe=medusa", "data.limit=null"])) == []


def test_range_checks_run_in_check_config_too():
    """compose_config users (bench-train, tests, sweeps) reach the same declared ranges through
    check_config."""
    from draftsmith import recipes
    from draftsmith.distill.engine.trainer import check_config

    with pytest.raises(
        ConfigError, match=r"^data\.limit=0 is out of range: allowed >= 1, or null \(all\)"
    ):
        check_config(
            compose_config(["recipe=medusa", "data.limit=0"]), recipes.get_recipe("medusa")
        )


# ------------------------------------------------------------------------------------------- --help
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_and_the_recipes(flag, tmp_path, monkeypatch, capsys):
    code, out, err = run_train_py([flag], tmp_path, monkeypatch, capsys)
    assert code == 0 and err == ""
    assert out.startswith("usage: python train.py recipe=NAME [key=value ...]")
    assert all(name in out for name in RECIPES) and "recipe=NAME --help" in out


def test_draftsmith_train_help_prints_the_usage(capsys):
    from draftsmith.cli.training import _cmd_train

    with pytest.raises(SystemExit) as ended:
        _cmd_train(["--help"])
    out = capsys.readouterr().out
    assert (
        ended.value.code == 0
        and out.startswith("usage: draftsmith train recipe=NAME")
        and "eagle3" in out
    )


def test_recipe_help_lists_its_keys_with_types_defaults_and_docs(tmp_path, monkeypatch, capsys):
    from draftsmith.recipes.eagle3 import Eagle3DrafterConfig

    code, out, _ = run_train_py(
        ["recipe=eagle3", "drafter.ttt_steps=5", "--help"], tmp_path, monkeypatch, capsys
    )
    assert code == 0
    lines = out.splitlines()
    ttt = next(line for line in lines if line.strip().startswith("drafter.ttt_steps:"))
    doc = next(
        f for f in dataclasses.fields(Eagle3DrafterConfig) if f.name == "ttt_steps"
    ).metadata["doc"]
    assert ttt.strip().startswith("drafter.ttt_steps: int = 5") and doc in ttt and "[>= 1]" in ttt
    assert any(line.strip().startswith("data.limit: int | None = 2000") for line in lines)
    own = [i for i, line in enumerate(lines) if line.strip().startswith("drafter.")]
    shared = [i for i, line in enumerate(lines) if line.strip().startswith("optim.")]
    assert max(own) < min(shared)  # the recipe's own keys first


# ------------------------------------------------------------------------------------- data, resume
def test_an_empty_data_folder_is_one_line_naming_what_it_must_hold(tmp_path):
    from draftsmith.distill.data.conversations import load_conversations

    for folder in (tmp_path / "empty", tmp_path / "no_data"):
        folder.mkdir()
    (tmp_path / "no_data" / "README.md").write_text("notes\n")
    for folder in (tmp_path / "empty", tmp_path / "no_data"):
        with pytest.raises(
            DataError,
            match=rf"^data folder {folder} holds no data files: a data folder must contain "
            r"\.jsonl, \.json or \.parquet files of chat conversations",
        ):
            load_conversations(str(folder))


def test_train_py_with_an_empty_data_folder_prints_one_line(
    tmp_path, monkeypatch, capsys, tiny_target_dir
):
    empty = tmp_path / "chats"
    empty.mkdir()
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "train.py",
            "recipe=medusa",
            f"target={tiny_target_dir}",
            f"data={empty}",
            "target.dtype=fp32",
            f"hydra.run.dir={tmp_path / 'run'}",
            "hydra.output_subdir=null",
            "hydra/job_logging=none",
            "hydra/hydra_logging=none",
        ],
    )
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as ended:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    needs = (
        "a data folder must contain .jsonl, .json or .parquet files of chat conversations (ShareGPT"
        " 'conversations' or OpenAI 'messages' records), or be a folder written by"
        " Dataset.save_to_disk"
    )
    assert ended.value.code == 1 and errors == [
        f"error: data folder {empty} holds no data files: {needs}"
    ], errors
