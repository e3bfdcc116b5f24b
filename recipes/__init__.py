"""Recipes wire target, data, modules and losses per method. Only train.py and the CLI import this package."""

from draftsmith.recipes import medusa  # noqa: F401  (registers the recipe)
from draftsmith.recipes.registry import RECIPES, get_recipe, register_recipe

__all__ = ["RECIPES", "get_recipe", "register_recipe"]
