"""Recipe registry: ``@register_recipe("name")`` on a ``build(cfg, target) -> Objective`` function."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from draftsmith.common.methods import METHODS

RECIPES: dict[str, Recipe] = {}


@dataclass(frozen=True)
class Recipe:
    """A training method: ``build`` wires modules and losses; ``validate`` checks config before the target loads."""

    name: str
    build: Callable[[Any, Any], Any]
    validate: Callable[[Any], None] | None = None


def register_recipe(name: str, validate: Callable[[Any], None] | None = None) -> Callable:
    """Decorator registering ``build(cfg, target) -> Objective`` under ``name``."""

    def wrap(build: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        if name in RECIPES:
            raise ValueError(f"recipe {name!r} registered twice")
        RECIPES[name] = Recipe(name, build, validate)
        return build

    return wrap


def all_recipes() -> dict[str, Recipe]:
    """Every recipe of this package, registered by importing each module (tests, scripts, listings)."""
    import draftsmith.recipes as package

    for info in pkgutil.iter_modules(package.__path__):
        if info.name != "registry":
            importlib.import_module(f"{package.__name__}.{info.name}" + (".objective" if info.ispkg else ""))
    return RECIPES


def get_recipe(name: str) -> Recipe:
    """Look a recipe up by name, importing only its own module (``recipes/<name>.py``): training one method never
    loads the others' rooms. An unknown name lists the valid ones, and a recipe missing from the method table
    (``common/methods.py``) is an error too: the table is what the CLI, the scripts and the tests read."""
    if name not in RECIPES and importlib.util.find_spec(f"draftsmith.recipes.{name}") is not None:
        module = importlib.import_module(f"draftsmith.recipes.{name}")
        if name not in RECIPES and getattr(module, "__path__", None):  # a package: its objective registers it
            importlib.import_module(f"draftsmith.recipes.{name}.objective")
    if name not in RECIPES and name not in all_recipes():  # a variant registered by another module (hydra_pp)
        raise KeyError(f"unknown recipe {name!r}; valid recipes: {', '.join(sorted(RECIPES))}")
    if name not in METHODS:
        raise KeyError(f"recipe {name!r} has no entry in the method table (common/methods.py METHODS); add one "
                       "(docs/ADDING_A_METHOD.md)")
    return RECIPES[name]
