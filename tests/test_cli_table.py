"""The one command table: every command has its module, arguments and handler; ``draftsmith train``
runs Hydra."""

from __future__ import annotations

import subprocess
import sys

import pytest

from draftsmith import cli

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_command_has_a_handler(name):
    module = cli.command_module(name)
    handlers = {**getattr(module, "HANDLERS", {}), **getattr(module, "RAW_HANDLERS", {})}
    assert name in handlers, (
        f"{name} is in cli.COMMANDS but {module.__name__} has no handler for it"
    )
    assert (name in cli.RAW_ARGV) == (name in getattr(module, "RAW_HANDLERS", {}))


def test_no_handler_outside_the_table():
    modules = {cli.command_module(n) for n in cli.COMMANDS}
    handled = {
        n for m in modules for n in {**getattr(m, "HANDLERS", {}), **getattr(m, "RAW_HANDLERS", {})}
    }
    assert handled == set(cli.COMMANDS)


def test_a_command_line_builds_only_its_own_arguments():
    only_bench = cli.build_parser("bench")
    args = only_bench.parse_args(["bench", "--drafter", "x", "--num-prompts", "2"])
    assert args.drafter == "x" and args.num_prompts == 2
    with pytest.raises(SystemExit):  # generate's --prompt is not built when the line is a bench
        only_bench.parse_args(["generate", "--prompt", "hi"])


@pytest.mark.e2e  # a `draftsmith train` subprocess
def test_draftsmith_train_composes_the_config_as_python_train_py_does(tmp_path):
    """`draftsmith train` loads train.py as draftsmith.train; Hydra must still find conf/ (it once
    did not)."""
    run = subprocess.run(
        [sys.executable, "-m", "draftsmith.cli", "train", "recipe=medusa", "--cfg", "job"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "name: medusa" in run.stdout
