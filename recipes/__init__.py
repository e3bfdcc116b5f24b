"""Recipes: one package per training method (``recipes/<name>/``: its schema and registration in
``__init__.py``, its objective and build in ``objective.py``). Only train.py, the CLI, scripts and
tests import this package.

Importing it registers every recipe listed in :data:`PACKAGES` (their declarations are light: no
torch, no model code); the method table the rest of the project reads is those registrations
(:mod:`.registration`). Adding a method adds its package and one name here
(docs/ADDING_A_METHOD.md).
"""

from __future__ import annotations

import importlib

from draftsmith.recipes.registration import (
    CONTROLLER,
    FAMILIES,
    RECIPES,
    Recipe,
    formats_of,
    get_recipe,
    labels,
    method_table_recipes,
    recipe_names,
    recipe_problems,
    register_recipe,
)

# Every recipe package, in the method table's row order (heads, drafters, self-speculative,
# controllers, targets).
PACKAGES = (
    "medusa",
    "medusa2",
    "hydra",
    "clover2",
    "eagle",
    "eagle3",
    "dflash",
    "kangaroo",
    "specdecpp",
    "adaptive_temperature",
    "learn2pd",
    "diffusion_adapt",
)
for _package in PACKAGES:
    importlib.import_module(f"{__name__}.{_package}")

__all__ = [
    "CONTROLLER",
    "FAMILIES",
    "PACKAGES",
    "RECIPES",
    "Recipe",
    "formats_of",
    "get_recipe",
    "labels",
    "method_table_recipes",
    "recipe_names",
    "recipe_problems",
    "register_recipe",
]
