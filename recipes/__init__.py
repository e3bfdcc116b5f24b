"""Recipes wire target, data, modules and losses per method. Only train.py and the CLI import this package.

``get_recipe(name)`` imports ``recipes/<name>.py`` alone, which registers its recipe; ``RECIPES`` (every recipe)
imports them all. Adding a method adds a file and one entry in ``common/methods.py``, never a line here.
"""

from typing import Any

from draftsmith.recipes.registry import all_recipes, get_recipe, register_recipe


def __getattr__(name: str) -> Any:
    if name == "RECIPES":  # every recipe, imported on first use (a training run imports only its own)
        return all_recipes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RECIPES", "all_recipes", "get_recipe", "register_recipe"]
