"""Recipe configs for tests, as train.py builds them: the recipe composed through Hydra (its
schema's values, its conf/recipe preset, the default target/data/trainer presets) once per process,
then an overlay of some keys. Typed (the schema's dataclass instance, what a recipe's ``build`` and
``validate`` read) or the composed DictConfig.
"""

from __future__ import annotations

import functools
from typing import Any

from omegaconf import DictConfig, OmegaConf

from draftsmith.cli.training import compose_config
from draftsmith.recipes import get_recipe


@functools.cache
def _composed(name: str) -> DictConfig:
    return compose_config([f"recipe={name}"])


def recipe_config(
    name: str, overlay: dict[str, Any] | DictConfig | None = None, *, typed: bool = True
) -> Any:
    """Recipe ``name``'s config with ``overlay`` (nested keys) merged in; the schema instance unless
    ``typed=False``."""
    cfg = OmegaConf.merge(_composed(name), overlay or {})
    return get_recipe(name).typed(cfg) if typed else cfg
