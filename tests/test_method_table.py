"""The one method table (common/methods.py) is complete and read: every recipe has an entry and every entry's files
and runtime proposer exist; the scripts and the CLI take their lists from it; the toy method of
docs/ADDING_A_METHOD.md (tests/toy_method) passes the same checks and trains."""

from __future__ import annotations

import dataclasses
import importlib.util
import runpy
import sys
from pathlib import Path

import head_family_utils
import pytest
import toy_method
from head_family_utils import fit_steps, fixed_batch

from draftsmith.common.methods import (
    CONTROLLER,
    METHODS,
    export_formats,
    formats_of,
    labels,
    method_problems,
    method_table_recipes,
)
from draftsmith.export.converters import (
    FORMATS,
    ConvertRequest,
    ExportFormat,
    converters,
    formats_for,
    register_format,
)
from draftsmith.export.converters import export_formats as converter_formats
from draftsmith.recipes import RECIPES, get_recipe
from draftsmith.runtime.drafting.base import registered_methods

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
tiny_target = head_family_utils.tiny_target  # the shared module-scoped fixture


@pytest.fixture
def toy():
    """The toy method registered (recipe, proposer, table entry) for one test, then removed."""
    method = toy_method.install()
    yield method
    toy_method.uninstall()


def test_every_recipe_has_an_entry_and_every_entry_a_recipe():
    assert sorted(set(RECIPES) - set(METHODS)) == [], "recipes without a METHODS entry (common/methods.py)"
    assert sorted(set(METHODS) - set(RECIPES)) == [], "METHODS entries without a registered recipe"
    assert {p.stem for p in (ROOT / "conf" / "recipe").glob("*.yaml")} == set(METHODS)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_entry_files_and_proposer_exist(name):
    method = METHODS[name]
    assert method_problems(method, ROOT, registered_methods()) == []
    assert method.config == f"conf/recipe/{name}.yaml"


def test_every_runtime_proposer_belongs_to_a_method():
    served = {m.proposer for m in METHODS.values()}
    assert sorted(set(registered_methods()) - served) == []


def test_the_checks_catch_what_is_missing():
    medusa = METHODS["medusa"]
    broken = dataclasses.replace(medusa, config="conf/recipe/nope.yaml", module="heads/nope.py",
                                 tests=("tests/test_nope.py",), proposer="nope")
    problems = "\n".join(method_problems(broken, ROOT, registered_methods()))
    for what in ("config conf/recipe/nope.yaml", "module heads/nope.py", "test tests/test_nope.py", "'nope'"):
        assert what in problems
    assert method_problems(dataclasses.replace(medusa, proposer=CONTROLLER), ROOT, []) == []
    with pytest.raises(ValueError, match="family"):
        dataclasses.replace(medusa, family="other")


def test_get_recipe_refuses_a_recipe_missing_from_the_table(monkeypatch):
    monkeypatch.setitem(RECIPES, "ghost", RECIPES["medusa"])
    with pytest.raises(KeyError, match="no entry in the method table"):
        get_recipe("ghost")


def test_formats_follow_the_converters():
    """The converters declare the formats (export/converters.py); the method table names only declared formats that
    hold the method (a converter may add a format the table does not list yet: the CLI reads the declarations)."""
    declared = converters()
    assert declared and set(export_formats()) <= set(converter_formats()) == {"draftsmith", *declared}
    for name, method in METHODS.items():
        assert set(method.formats) <= set(formats_for(name)), name
    for name in export_formats():  # today's table and declarations agree format by format
        holders = [n for n in METHODS if name in formats_of(n)]
        assert holders == [n for n in METHODS if name in formats_for(n)], name


def test_a_format_is_one_declaration_the_cli_reads(tmp_path, medusa_export):
    """A format registered by one module is a ``--format`` choice and is dispatched to, with no CLI edit."""
    from draftsmith.cli import build_parser
    from draftsmith.cli.exporting import _convert
    from draftsmith.export.format import read_config

    calls = []

    def convert(request: ConvertRequest) -> Path:
        calls.append((request.config["method"], request.source, request.options))
        return request.out

    register_format(ExportFormat("toy-engine", ("medusa",), convert, help="a throwaway layout"))
    try:
        parser = build_parser("export")
        choices = next(a for a in parser._subparsers._group_actions[0].choices["export"]._actions
                       if a.dest == "format").choices
        assert "toy-engine" in choices
        out = _convert(medusa_export, tmp_path / "x", "toy-engine", read_config(medusa_export), None, source="runs/x")
        assert out == tmp_path / "x" and calls == [("medusa", "runs/x", {})]
        with pytest.raises(ValueError, match=r"--format toy-engine does not hold 'eagle' exports; EAGLE-1 exports as"):
            _convert(medusa_export, tmp_path / "y", "toy-engine", {"method": "eagle"}, None)
    finally:
        FORMATS.unregister("toy-engine")


def test_the_cli_has_no_branch_on_a_format_name():
    source = (ROOT / "cli" / "training.py").read_text()
    assert [name for name in converters() if f'"{name}"' in source or f"'{name}'" in source] == []


def test_method_table_script_reads_the_table(toy, monkeypatch):
    monkeypatch.setitem(METHODS, toy.name, dataclasses.replace(toy, in_method_table=True, label="Toy!"))
    script = runpy.run_path(str(ROOT / "scripts" / "method_table.py"), run_name="method_table")
    assert script["DEFAULT_RECIPES"].split(",") == method_table_recipes()
    assert script["DEFAULT_RECIPES"].split(",")[-1] == "toy_echo"
    assert script["LABELS"] == labels() and script["LABELS"]["toy_echo"] == "Toy!"


def test_gpu_check_reads_the_table(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check_table", ROOT / "tests" / "gpu_check" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, gpu_check)  # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    assert gpu_check.NEEDS_INPUT == {n: m.needs_input for n, m in METHODS.items() if m.needs_input}
    assert gpu_check.TINY_TRAIN_EXTRA == {n: list(m.tiny_overrides) for n, m in METHODS.items() if m.tiny_overrides}


def test_cli_format_choices_and_refusals_come_from_the_table(tmp_path):
    from draftsmith.cli import build_parser
    from draftsmith.cli.exporting import _convert

    parser = build_parser()
    export = next(a for a in parser._subparsers._group_actions[0].choices["export"]._actions if a.dest == "format")
    assert list(export.choices) == converter_formats()
    with pytest.raises(ValueError, match=r"'medusa' exports; Medusa-1 exports as: draftsmith, medusa"):
        _convert(tmp_path, tmp_path / "out", "speculators", {"method": "medusa"}, None)


def test_the_toy_method_passes_the_checks(toy):
    assert toy.name in RECIPES and toy.proposer in registered_methods()
    assert method_problems(toy, ROOT, registered_methods()) == []
    assert get_recipe(toy.name).name == "toy_echo"
    gone = dataclasses.replace(toy, config="tests/toy_method/removed.yaml")  # its config deleted
    assert method_problems(gone, ROOT, registered_methods()) == [
        "toy_echo: config tests/toy_method/removed.yaml does not exist"]
    toy_method.uninstall()  # its proposer unregistered: the check names it
    assert "no runtime proposer" in " ".join(method_problems(toy, ROOT, registered_methods()))
    toy_method.install()


def test_the_toy_method_trains_exports_and_drafts(toy, tiny_target, tmp_path):
    import torch
    from omegaconf import OmegaConf

    from draftsmith.export.format import write_export
    from draftsmith.runtime.drafting.base import StepContext, build_proposer

    cfg = OmegaConf.load(ROOT / toy.config)
    get_recipe(toy.name).validate(cfg)
    objective = get_recipe(toy.name).build(cfg, tiny_target)
    losses = fit_steps(objective, tiny_target, fixed_batch(tiny_target.vocab_size, period=4), steps=2,
                       lr=float(cfg.optim.lr))
    assert len(losses) == 2 and losses[1] < losses[0]
    config = {**objective.export_config(), "target": {"name_or_path": tiny_target.name_or_path}}
    export = write_export(tmp_path / "export", objective.module.state_dict(), config)
    proposer = build_proposer(export, tiny_target.model)
    hidden = torch.randn(tiny_target.hidden_size)
    tree = proposer.propose(StepContext(tokens=torch.tensor([5, 6]), root_token=6, hidden=hidden))
    assert tree.tokens.tolist() == [6, int(objective.module(hidden).argmax())]


def test_the_guide_quotes_the_toy_as_it_is():
    import re

    guide = (ROOT / "docs" / "ADDING_A_METHOD.md").read_text()
    toy_lines = {line.strip() for f in (ROOT / "tests" / "toy_method").iterdir() if f.suffix in (".py", ".yaml")
                 for line in f.read_text().splitlines()}
    quoted = [line.strip() for block in re.findall(r"```(?:python|yaml)\n(.*?)```", guide, re.S)
              for line in block.splitlines() if line.strip()]
    assert len(quoted) > 50 and [line for line in quoted if line not in toy_lines] == []
