"""How many files and rooms one method spans, read from the method table and the registrations in the code.

    .venv/bin/python docs/tools/method_footprint.py [--json]

A method's footprint is every file that exists because of it (or that it shares with a sibling method): its entry in
``common/methods.py`` names its module (heads/, drafters/ or controllers/), its config (conf/recipe/), its export
formats and its tests; the code names the rest by registering it: the recipe file that calls
``register_recipe("<name>")`` (recipes/), the proposer family that calls ``register_proposer("<proposer>")`` or lists
it in ``SERVES`` (runtime/drafting/), and the converter modules that declare one of its formats (export/). Nothing is
imported: the files are read with ``ast``, so this runs before the code it describes can import.
docs/ARCHITECTURE.md prints the table (docs/tools/module_table.py writes it); tests/test_room_walk.py bounds it.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Where a method's registered pieces live, and the calls or module-level names that register them.
REGISTERED_IN = {
    "recipe": ("recipes", ("register_recipe",), ()),
    "proposer": ("runtime/drafting", ("register_proposer", "register_chain"), ("SERVES",)),
    "formats": ("export", ("register_format", "register_converter"), ("FORMAT", "FORMATS")),
}


def method_table(root: Path = ROOT) -> dict:
    """``METHODS`` of ``common/methods.py`` under ``root``, loaded from the file (it imports nothing of draftsmith)."""
    name = f"_method_table_{abs(hash(str(root)))}"
    spec = importlib.util.spec_from_file_location(name, root / "common" / "methods.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module.METHODS


def _strings(node: ast.AST, constants: dict[str, object]) -> list[str]:
    """The string values an expression names: a literal, a module-level constant, or a tuple/list of those."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name) and node.id in constants:
        value = constants[node.id]
        return [value] if isinstance(value, str) else [v for v in value if isinstance(v, str)]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [s for element in node.elts for s in _strings(element, constants)]
    return []


def registered_names(path: Path, calls: tuple[str, ...], declarations: tuple[str, ...]) -> set[str]:
    """Names a file registers: the first argument of every call to one of ``calls`` (or, when that argument is itself
    a call such as ``ExportFormat("gguf", methods, ...)``, its first two: the format and the methods it converts) and
    the values of the module-level ``declarations`` (e.g. ``SERVES = ("medusa", "medusa2")``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    constants: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                constants[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    names = {s for name in declarations if name in constants
             for s in ([constants[name]] if isinstance(constants[name], str) else constants[name])
             if isinstance(s, str)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if func in calls:
                first = node.args[0]
                for arg in first.args[:2] if isinstance(first, ast.Call) else [first]:
                    names.update(_strings(arg, constants))
    return names


def registrations(root: Path = ROOT) -> dict[str, dict[str, list[str]]]:
    """Kind (recipe, proposer, formats) -> registered name -> the files that register it."""
    found: dict[str, dict[str, list[str]]] = {}
    for kind, (folder, calls, declarations) in REGISTERED_IN.items():
        found[kind] = {}
        for path in sorted((root / folder).rglob("*.py")):
            for name in registered_names(path, calls, declarations):
                found[kind].setdefault(name, []).append(path.relative_to(root).as_posix())
    return found


def room_of(path: str) -> str:
    """A file's room: its top folder (``runtime/drafting/eagle.py`` is ``runtime``), or the file at the top level."""
    return Path(path).parts[0]


def _existing(root: Path, path: str) -> list[str]:
    return [path] if (root / path).is_file() else []


def footprint(method, found: dict[str, dict[str, list[str]]], root: Path = ROOT) -> dict[str, list[str]]:
    """Part -> files of one method (a ``common.methods.Method``); a recipe registered under a name imported from
    elsewhere is found by its file name, ``recipes/<name>/objective.py``."""
    formats = [f for f in getattr(method, "formats", ()) if f != "draftsmith"] + [method.name]
    return {"module": [method.module],
            "recipe": found["recipe"].get(method.name) or _existing(root, f"recipes/{method.name}/objective.py"),
            "config": [method.config],
            "proposer": found["proposer"].get(method.proposer or "", []),
            "converters": sorted({p for f in formats for p in found["formats"].get(f, [])}),
            "tests": list(method.tests)}


def footprints(root: Path = ROOT) -> dict[str, dict]:
    """Method -> its parts, its files (tests apart: they are counted but live in tests/) and its code rooms."""
    found, out = registrations(root), {}
    for name, method in method_table(root).items():
        parts = footprint(method, found, root)
        code = sorted({p for part, files in parts.items() if part != "tests" for p in files})
        out[name] = {"parts": parts, "files": len(code), "tests": len(parts["tests"]),
                     "rooms": sorted({room_of(p) for p in code})}
    return out


def method_owned(root: Path = ROOT) -> set[str]:
    """Every file some method's footprint names (the module table leaves these to the method table)."""
    return {p for fp in footprints(root).values() for files in fp["parts"].values() for p in files}


def markdown(result: dict[str, dict]) -> str:
    """One row per method: files and rooms its code spans, and the files themselves."""
    lines = ["| method | code files | rooms | module, recipe, config, proposer, converters | tests |",
             "|---|---|---|---|---|"]
    for name, fp in result.items():
        parts = fp["parts"]
        code = [f"`{p}`" for part in ("module", "recipe", "config", "proposer", "converters") for p in parts[part]]
        lines.append(f"| `{name}` | {fp['files']} | {len(fp['rooms'])} ({', '.join(fp['rooms'])}) | "
                     f"{', '.join(dict.fromkeys(code))} | {fp['tests']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Print the footprint of every method."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of the markdown table")
    result = footprints()
    print(json.dumps(result, indent=2) if parser.parse_args().json else markdown(result), end="")


if __name__ == "__main__":
    main()
