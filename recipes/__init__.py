"""Recipes wire target, data, modules and losses per method. Only train.py and the CLI import this package."""

from draftsmith.recipes import eagle, eagle3, medusa  # noqa: F401  (importing registers the recipes)
from draftsmith.recipes.registry import RECIPES, get_recipe, register_recipe

__all__ = ["RECIPES", "get_recipe", "register_recipe"]
