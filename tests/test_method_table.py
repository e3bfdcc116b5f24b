"""The method table is the recipes' registrations (recipes/<name>/__init__.py,
``@register_recipe``): every recipe has a config, its files, its build and the runtime proposer it
declares exist; the formats it declares are converters' that hold it; the scripts and the CLI take
their lists from the registrations; the toy method of docs/ADDING_A_METHOD.md (tests/toy_method)
registers, passes the same checks, trains, exports and drafts."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import head_family_utils
import pytest
import toy_method
from head_family_utils import fit_steps, fixed_batch

from draftsmith.distill.config.schema import TrainConfig
from draftsmith.export.converters import (
    FORMATS,
    ConvertRequest,
    ExportFormat,
    converters,
    formats_for,
    register_format,
)
from draftsmith.export.converters import export_formats as converter_formats
from draftsmith.recipes import (
    CONTROLLER,
    RECIPES,
    formats_of,
    get_recipe,
    labels,
    method_table_recipes,
    recipe_problems,
    register_recipe,
)
from draftsmith.runtime.drafting.registry import registered_methods

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
tiny_target = head_family_utils.tiny_target  # the shared module-scoped fixture


@pytest.fixture
def toy():
    """The toy method loaded in this process (its recipe and proposer registered) for one test, then
    removed."""
    package = toy_method.install()
    yield package
    toy_method.uninstall()


def test_every_recipe_has_a_config_and_every_config_a_recipe():
    assert {p.stem for p in (ROOT / "conf" / "recipe").glob("*.yaml")} == set(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_has_its_files_its_build_and_its_proposer(name):
    """Each declared runtime proposer is registered by a family module (runtime/drafting/registry.py
    loads them)."""
    assert recipe_problems(RECIPES[name], ROOT, registered_methods()) == []


def test_every_runtime_proposer_belongs_to_a_recipe():
    served = {r.proposer for r in RECIPES.values()}
    assert sorted(set(registered_methods()) - served) == []


def test_the_checks_catch_what_is_missing():
    medusa = RECIPES["medusa"]
    broken = dataclasses.replace(
        medusa,
        name="nope",
        module="heads/nope.py",
        tests=("tests/test_nope.py",),
        proposer="nope",
        build_at="draftsmith.recipes.medusa.objective:nope",
    )
    problems = "\n".join(recipe_problems(broken, ROOT, registered_methods()))
    for what in (
        "config conf/recipe/nope.yaml",
        "module heads/nope.py",
        "test tests/test_nope.py",
        "'nope'",
        "draftsmith.recipes.medusa.objective:nope cannot be imported",
    ):
        assert what in problems
    assert recipe_problems(dataclasses.replace(medusa, proposer=CONTROLLER), ROOT, []) == []


def test_a_registration_is_checked_when_it_is_made():
    @dataclass
    class Throwaway(TrainConfig):
        pass

    declaration = dict(
        label="X",
        module="heads/x.py",
        proposer=None,
        tests=("tests/x.py",),
        build=".objective:build",
    )
    with pytest.raises(ValueError, match="family 'other'; valid: heads, drafter"):
        register_recipe("throwaway", family="other", **declaration)
    with pytest.raises(ValueError, match="registered twice"):
        register_recipe("medusa", family="heads", **declaration)(Throwaway)
    with pytest.raises(TypeError, match="decorates a dataclass subclassing TrainConfig"):
        register_recipe("throwaway", family="heads", **declaration)(dict)
    with pytest.raises(ValueError, match="'module:function'"):
        register_recipe("throwaway", family="heads", **{**declaration, "build": "objective.build"})(
            Throwaway
        )
    assert "throwaway" not in RECIPES


def test_an_unknown_recipe_lists_the_registered_ones():
    with pytest.raises(
        KeyError, match=r"unknown recipe 'ghost'; valid recipes: adaptive_temperature, clover2, "
    ):
        get_recipe("ghost")


def test_formats_follow_the_converters():
    """The converters declare the formats (export/converters.py); a recipe names only declared
    formats that hold its method (a converter may add a format a recipe does not list yet: the CLI
    reads the declarations).
    """
    declared = converters()
    named = {f for r in RECIPES.values() for f in r.formats}
    assert declared and named <= set(converter_formats()) == {"draftsmith", *declared}
    for name, recipe in RECIPES.items():
        assert recipe.formats[0] == "draftsmith" and set(recipe.formats) <= set(
            formats_for(name)
        ), name
    for name in sorted(named):  # today's registrations and declarations agree format by format
        assert [n for n in RECIPES if name in formats_of(n)] == [
            n for n in RECIPES if name in formats_for(n)
        ], name


def test_a_format_is_one_declaration_the_cli_reads(tmp_path, medusa_export):
    """A format registered by one module is a ``--format`` choice and is dispatched to, with no CLI
    edit."""
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
        choices = next(
            a
            for a in parser._subparsers._group_actions[0].choices["export"]._actions
            if a.dest == "format"
        ).choices
        assert "toy-engine" in choices
        out = _convert(
            medusa_export,
            tmp_path / "x",
            "toy-engine",
            read_config(medusa_export),
            None,
            source="runs/x",
        )
        assert out == tmp_path / "x" and calls == [("medusa", "runs/x", {})]
        with pytest.raises(
            ValueError,
            match=r"--format toy-engine does not hold 'eagle' exports; EAGLE-1 exports as",
        ):
            _convert(medusa_export, tmp_path / "y", "toy-engine", {"method": "eagle"}, None)
    finally:
        FORMATS.unregister("toy-engine")


def test_the_cli_has_no_branch_on_a_format_name():
    source = (ROOT / "cli" / "training.py").read_text()
    assert [name for name in converters() if f'"{name}"' in source or f"'{name}'" in source] == []


def test_method_table_command_reads_the_registrations(monkeypatch):
    from draftsmith.cli import build_parser

    toy = dataclasses.replace(RECIPES["medusa"], name="toy", label="Toy!", in_method_table=True)
    monkeypatch.setitem(RECIPES, "toy", toy)
    args = build_parser("method-table").parse_args(["method-table"])
    assert args.recipes.split(",") == method_table_recipes()
    assert args.recipes.split(",")[-1] == "toy"
    assert labels()["toy"] == "Toy!"  # what cmd_method_table hands the table for its rows


def test_gpu_check_reads_the_registrations(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "gpu_check_table", ROOT / "tests" / "gpu_check" / "gpu_check.py"
    )
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, gpu_check)  # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    assert gpu_check.NEEDS_INPUT == {n: r.needs_input for n, r in RECIPES.items() if r.needs_input}
    assert gpu_check.TINY_TRAIN_EXTRA == {
        n: list(r.tiny_overrides) for n, r in RECIPES.items() if r.tiny_overrides
    }


def test_cli_format_choices_and_refusals_come_from_the_registrations(tmp_path):
    from draftsmith.cli import build_parser
    from draftsmith.cli.exporting import _convert

    parser = build_parser()
    export = next(
        a
        for a in parser._subparsers._group_actions[0].choices["export"]._actions
        if a.dest == "format"
    )
    assert list(export.choices) == converter_formats()
    with pytest.raises(
        ValueError, match=r"'medusa' exports; Medusa-1 exports as: draftsmith, medusa"
    ):
        _convert(tmp_path, tmp_path / "out", "speculators", {"method": "medusa"}, None)


def test_the_toy_method_registers_and_passes_the_checks(toy):
    recipe = get_recipe("toy")
    assert recipe.schema is toy.Toy and recipe.proposer in registered_methods()
    # its files, under tests/toy_method
    assert recipe_problems(recipe, toy_method.TOY, registered_methods()) == []
    unserved = recipe_problems(
        recipe, toy_method.TOY, [m for m in registered_methods() if m != "toy"]
    )
    assert unserved == ["toy: no runtime proposer registered for export method 'toy'"]


def test_the_toy_method_trains_exports_and_drafts(toy, tiny_target, tmp_path):
    import torch

    from draftsmith.export.format import write_export
    from draftsmith.runtime.drafting.base import StepContext
    from draftsmith.runtime.drafting.registry import build_proposer
    from draftsmith.runtime.target.hf import HFModelAdapter

    # the schema's values (a typed config; train.py composes the same through Hydra)
    cfg = toy.Toy()
    objective = get_recipe("toy").build(cfg, tiny_target)
    losses = fit_steps(
        objective, tiny_target, fixed_batch(tiny_target.vocab_size, period=4), steps=2, lr=3e-3
    )
    assert len(losses) == 2 and losses[1] < losses[0]
    config = {**objective.export_config(), "target": {"name_or_path": tiny_target.name_or_path}}
    export = write_export(tmp_path / "export", objective.module.state_dict(), config)
    proposer = build_proposer(
        export, HFModelAdapter(tiny_target.model)
    )  # a runtime target, as serving loads one
    hidden = torch.randn(tiny_target.hidden_size)
    tree = proposer.propose(StepContext(tokens=torch.tensor([5, 6]), root_token=6, hidden=hidden))
    assert tree.tokens.tolist() == [6, int(objective.module(hidden).argmax())]


def test_the_guide_quotes_the_toy_as_it_is():
    import re

    guide = (ROOT / "docs" / "ADDING_A_METHOD.md").read_text()
    toy_lines = {
        line.strip()
        for f in toy_method.TOY.rglob("*")
        if f.suffix in (".py", ".yaml")
        for line in f.read_text().splitlines()
    }
    quoted = [
        line.strip()
        for block in re.findall(r"```(?:python|yaml)\n(.*?)```", guide, re.S)
        for line in block.splitlines()
        if line.strip()
    ]
    assert len(quoted) > 50 and [line for line in quoted if line not in toy_lines] == []
