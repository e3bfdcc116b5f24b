"""How a training method declares itself: ``@register_recipe(...)`` on its schema class, once.

The decorator records everything the rest of the project asks about a method (:class:`Recipe`): its
label and family, the file of its nn.Module, the runtime proposer that serves its exports, the
engine formats those exports convert to, its tests, and where its ``build`` and ``validate`` live;
and it stores the schema in Hydra's ConfigStore as ``schema/<name>`` (``conf/train.yaml`` merges it
first, so Hydra refuses a key the schema lacks). The method table (:data:`RECIPES`, read by the CLI,
the scripts, the tests and ``docs/tools/method_footprint.py``) is these registrations, nothing else.
Light on purpose (no torch): ``build`` and ``validate`` are named as ``"module:function"``
(``.objective:build`` is relative to the schema's package) and imported when a run asks for them, so
``--help`` and config checks never load a model's code.

``build(cfg, target)`` and ``validate(cfg)`` receive the config as the schema's dataclass instance
(``OmegaConf.to_object``): typed values, checked against the declared ranges before they are called.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from draftsmith.common.errors import ConfigError
from draftsmith.distill.config.schema import TrainConfig
from draftsmith.export.schema import add_method_source

FAMILIES = ("heads", "drafter", "self-speculative", "controller", "target-adaptation")
CONTROLLER = (  # ``proposer`` of a method served beside a proposer (a policy, a filter), not as one
    "controller"
)
NATIVE_FORMAT = (  # the export itself: every method has it (export/converters.py's NATIVE_FORMAT)
    "draftsmith"
)


@dataclass(frozen=True)
class Recipe:
    """One training method (paths relative to the repository root, the ``draftsmith`` package
    folder).

    ``proposer``: the export ``method`` a runtime proposer is registered for
    (``@register_proposer``), ``CONTROLLER`` for a method the runtime serves some other way, None
    for one that serves nothing (it makes a target).
    ``formats``: the ``draftsmith export --format`` values its exports convert to, ``draftsmith``
    first.
    ``tiny_overrides``: Hydra overrides a tiny (4-layer) target needs. ``needs_input``: why it
    cannot train on chat data alone, if it cannot. ``in_method_table``: trained and benched by
    ``draftsmith method-table`` by default.
    """

    name: str
    label: str
    family: str
    schema: type[TrainConfig]
    module: str
    proposer: str | None
    tests: tuple[str, ...]
    build_at: str
    validate_at: str | None = None
    formats: tuple[str, ...] = (NATIVE_FORMAT,)
    tiny_overrides: tuple[str, ...] = ()
    needs_input: str | None = None
    in_method_table: bool = False

    @property
    def config(self) -> str:
        """The recipe's Hydra config (``python train.py recipe=<name>``)."""
        return f"conf/recipe/{self.name}.yaml"

    def typed(self, cfg: DictConfig | TrainConfig) -> TrainConfig:
        """``cfg`` as an instance of the schema: a composed config through ``OmegaConf.to_object``
        (a required key left unset is a ConfigError naming it); an instance passes through."""
        if isinstance(cfg, self.schema):
            return cfg
        node = cfg
        # an overlay of some keys: the schema gives the rest
        if OmegaConf.get_type(cfg) is not self.schema:
            node = OmegaConf.merge(OmegaConf.structured(self.schema), cfg)
        missing = sorted(OmegaConf.missing_keys(node))
        if missing:
            raise ConfigError(
                f"missing required config fields: {', '.join(missing)} (set them on the command"
                " line, e.g. data=PATH)"
            )
        return OmegaConf.to_object(node)

    def validate(self, cfg: DictConfig | TrainConfig) -> None:
        """Everything checkable before the target loads: the declared ranges
        (distill/config/checks.py), then the recipe's own ``validate`` (what one key's range cannot
        say: keys that depend on each other, files it reads).
        """
        from draftsmith.distill.config.checks import check_schema

        check_schema(cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg))
        typed = self.typed(cfg)
        if self.validate_at is not None:
            resolve(self.validate_at)(typed)

    def build(self, cfg: DictConfig | TrainConfig, target: Any) -> Any:
        """The recipe's objective (``distill.engine.objective.Objective``) for ``target``."""
        return resolve(self.build_at)(self.typed(cfg), target)


RECIPES: dict[str, Recipe] = {}


def served_methods() -> list[str]:
    """The export methods the recipes' exports carry and a runtime proposer serves (their
    ``proposer``)."""
    return [r.proposer for r in RECIPES.values() if r.proposer not in (None, CONTROLLER)]


add_method_source(
    served_methods
)  # a recipe's exports read wherever the recipes are loaded (train.py, the CLI)


def register_recipe(
    name: str,
    *,
    label: str,
    family: str,
    module: str,
    proposer: str | None,
    tests: tuple[str, ...],
    build: str,
    validate: str | None = None,
    formats: tuple[str, ...] = (),
    tiny_overrides: tuple[str, ...] = (),
    needs_input: str | None = None,
    in_method_table: bool = False,
) -> Callable[[type], type]:
    """Decorator on a recipe's schema class (a ``TrainConfig`` dataclass) registering the method
    ``name``; ``build`` and ``validate`` are ``"module:function"`` (a leading dot: relative to the
    schema's package), ``formats`` the engine formats beyond ``draftsmith`` (each must be declared
    by a converter that holds the method).
    """
    if family not in FAMILIES:
        raise ValueError(f"recipe {name!r}: family {family!r}; valid: {', '.join(FAMILIES)}")

    def wrap(schema: type) -> type:
        if not (dataclasses.is_dataclass(schema) and issubclass(schema, TrainConfig)):
            raise TypeError(
                f"recipe {name!r}: @register_recipe decorates a dataclass subclassing TrainConfig"
            )
        if name in RECIPES:
            raise ValueError(f"recipe {name!r} registered twice")
        package = sys.modules[schema.__module__].__package__
        RECIPES[name] = Recipe(
            name,
            label,
            family,
            schema,
            module,
            proposer,
            tuple(tests),
            _absolute(build, package),
            _absolute(validate, package) if validate else None,
            (NATIVE_FORMAT, *formats),
            tuple(tiny_overrides),
            needs_input,
            in_method_table,
        )
        from hydra.core.config_store import ConfigStore

        ConfigStore.instance().store(group="schema", name=name, node=schema)
        return schema

    return wrap


def _absolute(reference: str, package: str) -> str:
    module, _, function = reference.partition(":")
    if not function:
        raise ValueError(f"{reference!r}: name a function as 'module:function'")
    return f"{package}{module}:{function}" if module.startswith(".") else reference


def resolve(reference: str) -> Callable[..., Any]:
    """The function a ``"module:function"`` reference names (its module imported on first use)."""
    module, _, function = reference.partition(":")
    return getattr(importlib.import_module(module), function)


def unregister_recipe(name: str) -> None:
    """Remove ``name`` (tests registering throwaway recipes); its schema stays in the ConfigStore,
    unused."""
    del RECIPES[name]


def get_recipe(name: str) -> Recipe:
    """The registered recipe ``name``; an unknown name lists the registered ones."""
    if name not in RECIPES:
        raise KeyError(f"unknown recipe {name!r}; valid recipes: {', '.join(recipe_names())}")
    return RECIPES[name]


def recipe_names() -> list[str]:
    """Every registered recipe, sorted."""
    return sorted(RECIPES)


def formats_of(method: str) -> tuple[str, ...]:
    """The export formats the recipe whose export ``method`` key (or name) is ``method``
    declares."""
    return get_recipe(method).formats


def method_table_recipes() -> list[str]:
    """Recipes the equal-budget method table trains by default, in registration order."""
    return [r.name for r in RECIPES.values() if r.in_method_table]


def labels() -> dict[str, str]:
    """Recipe name -> display label (tables, plots)."""
    return {r.name: r.label for r in RECIPES.values()}


def recipe_problems(recipe: Recipe, root: str | Path, proposers: Collection[str]) -> list[str]:
    """What is missing for ``recipe``: its config, module or test files under ``root``, its
    ``build``/``validate`` functions, or (``proposers``: the export methods the runtime has
    proposers for) the runtime proposer it declares. Empty when complete."""
    root = Path(root)
    problems = [
        f"{recipe.name}: {what} {path} does not exist"
        for what, paths in (
            ("config", (recipe.config,)),
            ("module", (recipe.module,)),
            ("test", recipe.tests),
        )
        for path in paths
        if not (root / path).is_file()
    ]
    if not recipe.tests:
        problems.append(f"{recipe.name}: no test files listed")
    for reference in filter(None, (recipe.build_at, recipe.validate_at)):
        try:
            resolve(reference)
        except (ImportError, AttributeError) as err:
            problems.append(f"{recipe.name}: {reference} cannot be imported ({err})")
    if recipe.proposer not in (None, CONTROLLER) and recipe.proposer not in proposers:
        problems.append(
            f"{recipe.name}: no runtime proposer registered for export method {recipe.proposer!r}"
        )
    return problems


def untyped(cfg: TrainConfig) -> DictConfig:
    """A typed config back as the DictConfig distill/'s data code reads (``cfg.data``,
    ``cfg.run``)."""
    return OmegaConf.structured(cfg)
