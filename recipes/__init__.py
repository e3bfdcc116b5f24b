"""Recipes wire target, data, modules and losses per method. Only train.py and the CLI import this package.

Every module in this package except ``registry`` is imported here, which registers its recipe: adding a method
adds a file, never a line to a list.
"""

import importlib
import pkgutil

from draftsmith.recipes.registry import RECIPES, get_recipe, register_recipe

for _info in pkgutil.iter_modules(__path__):
    if _info.name != "registry":
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["RECIPES", "get_recipe", "register_recipe"]
