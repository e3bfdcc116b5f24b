"""Issue 50's config refusals, each one line before anything loads: every Hydra ``trainer.*`` key
range-checked (``trainer.max_time=tomorrow``, ``trainer.precision=banana``, ``trainer=ddp
trainer.devices=0`` reached Lightning after the target loaded), a key given twice (``recipe=medusa
recipe=hydra`` trained hydra), and a recipe that only a YAML file names (listed among the valid
recipes while refused as unknown)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_config_schema import error_lines, run_train_py

from draftsmith.cli.training import compose_config

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["trainer.max_time=tomorrow"],
            "error: trainer.max_time=tomorrow is out of range: allowed DD:HH:MM:SS",
        ),
        (
            ["trainer.max_time=00:25:00:00"],
            "error: trainer.max_time=00:25:00:00 is out of range: allowed DD:HH:MM:SS",
        ),
        (
            ["trainer.precision=banana"],
            "error: trainer.precision=banana is out of range: allowed one of auto, 32-true",
        ),
        (
            ["trainer=ddp", "trainer.devices=0"],
            (
                "error: trainer.devices=0 is out of range: allowed -1 or auto (every "
                "visible device), a count >= 1, or a list of device ids"
            ),
        ),
        (["trainer.devices=-2"], "error: trainer.devices=-2 is out of range: allowed -1 or auto"),
        (["trainer.devices=[]"], "error: trainer.devices=[] is out of range: allowed -1 or auto"),
        (
            ["trainer.accelerator=tpuu"],
            "error: trainer.accelerator=tpuu is out of range: allowed one of cpu, gpu, cuda",
        ),
        (
            ["trainer.strategy=nope"],
            "error: trainer.strategy=nope is out of range: allowed one of auto, single_device",
        ),
        (["trainer.max_steps=-3"], "error: trainer.max_steps=-3 is out of range: allowed >= 1"),
        (
            ["trainer.accumulate_grad_batches=0"],
            "error: trainer.accumulate_grad_batches=0 is out of range: allowed >= 1",
        ),
        (
            ["trainer=fsdp", "trainer.fsdp.sharding_strategy=HALF"],
            (
                "error: trainer.fsdp.sharding_strategy=HALF is out of range: allowed one of"
                " FULL_SHARD, SHARD_GRAD_OP"
            ),
        ),
        (
            ["trainer=fsdp", "trainer.fsdp.state_dict_type=pieces"],
            (
                "error: trainer.fsdp.state_dict_type=pieces is out of range: allowed one of full,"
                " sharded"
            ),
        ),
    ],
)
def test_every_trainer_key_is_range_checked_before_anything_loads(
    overrides, expected, tmp_path, monkeypatch, capsys
):
    """Issue 50: these reached Lightning (after the target loaded) and ended in a traceback."""
    code, _, err = run_train_py(["recipe=medusa", *overrides], tmp_path, monkeypatch, capsys)
    lines = error_lines(err)
    assert code == 1 and len(lines) == 1 and lines[0].startswith(expected), err


@pytest.mark.parametrize(
    "override",
    [
        "trainer.precision=auto",
        "trainer.precision=bf16-mixed",
        "trainer.devices=auto",
        "trainer.devices=-1",
        "trainer.devices=[0,1]",
        "trainer.max_time=01:12:30:00",
        "trainer.max_time=null",
        "trainer.accelerator=auto",
        "trainer.strategy=ddp",
    ],
)
def test_valid_trainer_values_pass(override):
    from draftsmith.cli.train_command_line import preflight
    from draftsmith.distill.config.checks import schema_problems

    assert preflight(["recipe=medusa", override]) is None
    assert schema_problems(compose_config(["recipe=medusa", override])) == []


def test_every_trainer_preset_passes_its_own_checks():
    from draftsmith.distill.config.checks import schema_problems

    for preset in sorted(p.stem for p in (ROOT / "conf" / "trainer").glob("*.yaml")):
        assert schema_problems(compose_config(["recipe=eagle3", f"trainer={preset}"])) == [], preset


@pytest.mark.parametrize(
    "argv",
    [
        ["recipe=medusa", "recipe=hydra"],
        ["recipe=medusa", "optim.lr=1e-3", "optim.lr=2e-3"],
        ["recipe=medusa", "heads.num_heads=2", "+heads.num_heads=3"],
    ],
)
def test_a_key_given_twice_is_refused_in_one_line(argv, tmp_path, monkeypatch, capsys):
    """Issue 50: `recipe=medusa recipe=hydra` trained hydra without a word (Hydra keeps the last
    group choice)."""
    code, _, err = run_train_py(argv, tmp_path, monkeypatch, capsys)
    lines = error_lines(err)
    key = argv[-1].split("=", 1)[0].lstrip("+")
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {key} is given twice ("), err


def test_what_lightnings_ddp_launcher_appends_is_not_a_key_given_twice(tmp_path):
    """A further DDP process is this command line plus Lightning's hydra.run.dir / hydra.job.name /
    hydra.output_subdir (lightning_fabric's _hydra_subprocess_cmd): refusing those as repeated
    killed every `trainer=ddp` run whose command gave hydra.run.dir. The user's own repeats are
    still refused."""
    from draftsmith.cli.train_command_line import preflight

    user = ["recipe=medusa", f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"]
    child = [
        *user,
        f'hydra.run.dir="{tmp_path}"',
        "hydra.job.name=train_ddp_process_1",
        "hydra.output_subdir=null",
    ]
    assert preflight(child) is None
    assert preflight([*user, f"hydra.run.dir={tmp_path}"]).startswith(
        "hydra.run.dir is given twice ("
    )
    repeats = [*user, "optim.lr=1e-3", "optim.lr=2e-3", *child[len(user) :]]
    assert preflight(repeats).startswith("optim.lr is given twice (")


def test_the_valid_recipes_are_the_registered_ones_not_the_yaml_files(tmp_path, monkeypatch):
    """A YAML under conf/recipe/ without a registered recipe was refused as "unknown recipe 'X';
    valid recipes: ..., X, ..." (the list globbed the YAML files)."""
    import shutil

    import draftsmith.cli.train_command_line as command_line

    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    (conf / "recipe" / "ghost.yaml").write_text("# @package _global_\nrecipe:\n  name: ghost\n")
    monkeypatch.setattr(command_line, "CONF_DIR", conf)
    message = command_line.preflight(["recipe=ghost"])
    assert message.startswith("unknown recipe 'ghost'; valid recipes: "), message
    assert "ghost" not in message.split("valid recipes: ", 1)[1] and "medusa" in message
    assert "ghost" not in command_line.recipe_names()


def test_a_drafter_export_given_as_the_target_is_named_before_anything_loads(tmp_path):
    """``target=EXPORT`` (a drafter, not a model) is one line saying what the folder is, not a
    tokenizer error."""
    from draftsmith.distill.config.checks import target_folder_problem

    export = tmp_path / "medusa_export"
    export.mkdir()
    (export / "config.json").write_text(
        json.dumps(
            {
                "format": "draftsmith",
                "method": "medusa",
                "architecture": {},
                "target": {"name_or_path": "smollm2-135m"},
            }
        )
    )
    (export / "model.safetensors").write_bytes(b"")
    problem = target_folder_problem(str(export))
    assert problem is not None and problem.startswith(
        f"target.name_or_path={export} is a draftsmith"
    )
    assert "not a target model" in problem
    assert (
        target_folder_problem("smollm2-135m") is None
        and target_folder_problem(str(tmp_path / "nosuch")) is None
    )
