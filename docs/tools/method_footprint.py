"""How many places and rooms one method spans, read from its registrations.

    .venv/bin/python docs/tools/method_footprint.py [--json]

A method's footprint is every place that exists because of it (or that it shares with a sibling
method), as the code registers it: its recipe package (``recipes/<name>/``: the package of the
schema class ``@register_recipe`` decorates), the nn.Module file and the config its registration
names, the runtime family module that registers the builder serving its exports (runtime/drafting/),
and the converter modules that declare one of its formats (export/). Its tests are counted apart.
docs/ARCHITECTURE.md prints the table (docs/tools/module_table.py writes it);
tests/test_room_walk.py bounds it. It imports the code it describes (the registrations are the
code), from the ``draftsmith`` package on the path.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def method_table(root: Path = ROOT) -> dict:
    """Every registered recipe (``draftsmith.recipes.RECIPES``), in the method table's order."""
    from draftsmith.recipes import RECIPES

    return RECIPES


def module_path(module: str) -> str:
    """The repository path of an imported ``draftsmith`` module (``runtime/drafting/eagle.py``)."""
    import draftsmith

    return (
        Path(sys.modules[module].__file__).relative_to(Path(draftsmith.__file__).parent).as_posix()
    )


def recipe_package(recipe) -> str:
    """``recipes/<package>/``: the folder of the recipe's schema (its registration, objective and
    helpers)."""
    return str(Path(module_path(recipe.schema.__module__)).parent.as_posix()) + "/"


def footprint(recipe) -> dict[str, list[str]]:
    """Part -> places of one method (a ``draftsmith.recipes.Recipe``): files, and its recipe package
    as a folder."""
    from draftsmith.export.converters import NATIVE_FORMAT, converters
    from draftsmith.runtime.drafting.registry import proposer_module, registered_methods

    formats = converters()
    serves = recipe.proposer in registered_methods()
    return {
        "module": [recipe.module],
        "recipe": [recipe_package(recipe)],
        "config": [recipe.config],
        "proposer": [module_path(proposer_module(recipe.proposer))] if serves else [],
        "converters": sorted(
            {
                module_path(formats[f].convert.__module__)
                for f in recipe.formats
                if f != NATIVE_FORMAT and f in formats
            }
        ),
        "tests": list(recipe.tests),
    }


def room_of(path: str) -> str:
    """A file's room: its top folder (``runtime/drafting/eagle.py`` is ``runtime``), or the file at
    the top level."""
    return Path(path).parts[0]


def footprints(root: Path = ROOT) -> dict[str, dict]:
    """Method -> its parts, its places (tests apart: they are counted but live in tests/) and its
    code rooms."""
    out = {}
    for name, recipe in method_table(root).items():
        parts = footprint(recipe)
        code = sorted({p for part, places in parts.items() if part != "tests" for p in places})
        out[name] = {
            "parts": parts,
            "files": len(code),
            "tests": len(parts["tests"]),
            "rooms": sorted({room_of(p) for p in code}),
        }
    return out


def method_owned(root: Path = ROOT) -> set[str]:
    """Every file some method's footprint names, its recipe packages' files included (the module
    table leaves these to the method table)."""
    places = {
        p for fp in footprints(root).values() for files in fp["parts"].values() for p in files
    }
    return {
        f.relative_to(root).as_posix()
        for p in places
        if p.endswith("/")
        for f in (root / p).rglob("*.py")
    } | {p for p in places if not p.endswith("/")}


def markdown(result: dict[str, dict]) -> str:
    """One row per method: places and rooms its code spans, and the places themselves."""
    lines = [
        "| method | code places | rooms | module, recipe, config, proposer, converters | tests |",
        "|---|---|---|---|---|",
    ]
    for name, fp in result.items():
        parts = fp["parts"]
        code = [
            f"`{p}`"
            for part in ("module", "recipe", "config", "proposer", "converters")
            for p in parts[part]
        ]
        lines.append(
            f"| `{name}` | {fp['files']} | {len(fp['rooms'])} ({', '.join(fp['rooms'])}) | "
            f"{', '.join(dict.fromkeys(code))} | {fp['tests']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Print the footprint of every method."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--json", action="store_true", help="print JSON instead of the markdown table"
    )
    result = footprints()
    print(json.dumps(result, indent=2) if parser.parse_args().json else markdown(result), end="")


if __name__ == "__main__":
    main()
