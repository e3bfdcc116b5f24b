"""A toy method as a newcomer adds one (docs/ADDING_A_METHOD.md), laid out as in the repository:
each file under this folder goes to the same path in a checkout (:data:`PLACED`), and two lists name
it (:data:`LISTED`).

tests/test_adding_a_method.py places it in a copy of the repository, trains it through
``train.py recipe=toy``, exports and serves it, and counts the files that changed;
tests/test_method_table.py loads it here, in-process, under the module names it would have
(:func:`install`), and checks it like every real method.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

TOY = Path(__file__).resolve().parent
NAME = "toy"
# The toy's files, at the paths a real method's take (the same relative path here and in a
# checkout).
PLACED = (
    "heads/toy.py",
    "recipes/toy/__init__.py",
    "recipes/toy/objective.py",
    "conf/recipe/toy.yaml",
    "runtime/drafting/toy.py",
    "tests/test_toy.py",
)
# The lists that name every method, and the one name the toy adds to each: file -> (line before,
# line after).
LISTED = {
    "recipes/__init__.py": ('    "diffusion_adapt",\n)', '    "diffusion_adapt",\n    "toy",\n)'),
    "runtime/drafting/registry.py": ('    "specdecpp",\n)', '    "specdecpp",\n    "toy",\n)'),
}
# Module name -> file, in import order (each imports the ones before it).
MODULES = {
    "draftsmith.heads.toy": "heads/toy.py",
    "draftsmith.recipes.toy": "recipes/toy/__init__.py",
    "draftsmith.recipes.toy.objective": "recipes/toy/objective.py",
    "draftsmith.runtime.drafting.toy": "runtime/drafting/toy.py",
}


def place(repo: Path) -> None:
    """Add the toy to the checkout ``repo``: its files copied to their paths, its name added to the
    two lists."""
    for rel in PLACED:
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(TOY / rel, repo / rel)
    for rel, (before, after) in LISTED.items():
        text = (repo / rel).read_text()
        assert text.count(before + "\n") == 1, (
            f"{rel}: the list the toy joins moved; update LISTED in {__file__}"
        )
        (repo / rel).write_text(text.replace(before + "\n", after + "\n"))


def _load(name: str, path: Path) -> ModuleType:
    package = [str(path.parent)] if path.name == "__init__.py" else None
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=package)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_loaded: list[
    str
] = []  # what install() loaded here (nothing in a checkout where the toy is placed for real)


def install() -> ModuleType:
    """Load the toy in this process under the names it has in a checkout, which registers its recipe
    and proposer (the real lists stay as they are); in a checkout that holds it already
    (tests/test_adding_a_method.py's copy), the toy the lists registered. Returns its recipe
    package."""
    from draftsmith.recipes import RECIPES
    from draftsmith.runtime.drafting.registry import load_families

    load_families()
    if NAME not in RECIPES:
        for name, rel in MODULES.items():
            _load(name, TOY / rel)
            _loaded.append(name)
    return sys.modules["draftsmith.recipes.toy"]


def uninstall() -> None:
    """Undo :func:`install`, so the toy never leaks into other tests' view of the registries."""
    from draftsmith.recipes import RECIPES
    from draftsmith.runtime.drafting.registry import _REGISTRY

    if not _loaded:
        return
    RECIPES.pop(NAME, None)
    if NAME in _REGISTRY:
        _REGISTRY.unregister(NAME)
    for name in _loaded:
        sys.modules.pop(name, None)
    _loaded.clear()
