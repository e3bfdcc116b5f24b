"""The one method table: every training method (one per ``conf/recipe/<name>.yaml``) and the files that make it.

Pure data, importing nothing of draftsmith, so every room may read it. Readers: ``scripts/method_table.py`` (the
equal-budget table's recipes and labels), ``tests/gpu_check/gpu_check.py`` (which recipes train standalone, tiny-run
overrides), the CLI (``export --format`` choices and per-method format errors), ``recipes.get_recipe`` (a recipe
with no entry here is an error). ``tests/test_method_table.py`` keeps the table true: every registered recipe has an
entry and every entry's config, module, tests and runtime proposer exist. Adding a method: docs/ADDING_A_METHOD.md.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

CONTROLLER = "controller"  # ``proposer`` of a method served beside a proposer (a policy, a filter), not as one


@dataclass(frozen=True)
class Method:
    """One training method. Paths are relative to the repository root (the ``draftsmith`` package folder).

    ``proposer``: the export ``method`` a runtime proposer is registered for (``@register_proposer``), ``CONTROLLER``
    for a method the runtime serves some other way, None for one that serves nothing (it makes a target).
    ``formats``: the ``draftsmith export --format`` values its exports convert to. ``tiny_overrides``: Hydra
    overrides a tiny (4-layer) target needs. ``needs_input``: why it cannot train on chat data alone, if it cannot.
    ``in_method_table``: trained and benched by ``scripts/method_table.py`` by default.
    """

    name: str
    label: str
    family: str
    module: str
    proposer: str | None
    tests: tuple[str, ...]
    formats: tuple[str, ...] = ("draftsmith",)
    tiny_overrides: tuple[str, ...] = ()
    needs_input: str | None = None
    in_method_table: bool = False
    config: str = ""

    def __post_init__(self) -> None:
        if not self.config:
            object.__setattr__(self, "config", f"conf/recipe/{self.name}.yaml")
        if self.family not in FAMILIES:
            raise ValueError(f"method {self.name!r}: family {self.family!r}; valid: {', '.join(FAMILIES)}")
        if "draftsmith" not in self.formats:
            raise ValueError(f"method {self.name!r}: formats {self.formats} must include 'draftsmith'")


FAMILIES = ("heads", "drafter", "self-speculative", "controller", "target-adaptation")
_HEADS_TABLE = dict(family="heads", in_method_table=True)
_MEDUSA = ("draftsmith", "medusa", "medusa-tgi")  # vLLM layout, FasterDecoding/TGI layout

# Insertion order is the method table's row order (in_method_table entries first).
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("medusa", "Medusa-1", module="heads/medusa.py", proposer="medusa", formats=_MEDUSA, **_HEADS_TABLE,
           tests=("tests/test_medusa.py", "tests/test_medusa_draft_vocab.py", "tests/test_integration_medusa.py")),
    Method("medusa2", "Medusa-2 (lossy)", module="heads/medusa.py", proposer="medusa2", formats=_MEDUSA,
           **_HEADS_TABLE, tests=("tests/test_medusa2.py", "tests/test_medusa2_runtime.py")),
    Method("hydra", "Hydra", module="heads/hydra.py", proposer="hydra", **_HEADS_TABLE,
           tests=("tests/test_hydra.py", "tests/test_hydra_runtime.py")),
    Method("hydra_pp", "Hydra++", module="heads/hydra.py", proposer="hydra_pp", **_HEADS_TABLE,
           tests=("tests/test_hydra.py", "tests/test_head_family_train.py")),
    Method("clover2", "Clover-2", module="heads/clover.py", proposer="clover2", **_HEADS_TABLE,
           tests=("tests/test_clover.py", "tests/test_clover_runtime.py")),
    Method("eagle", "EAGLE-1", "drafter", module="drafters/eagle.py", proposer="eagle", in_method_table=True,
           tests=("tests/test_eagle.py", "tests/test_eagle_runtime.py", "tests/test_eagle_sampling.py")),
    Method("eagle3", "EAGLE-3", "drafter", module="drafters/eagle3.py", proposer="eagle3", in_method_table=True,
           formats=("draftsmith", "speculators", "sglang", "gguf"), tiny_overrides=("drafter.target_layers=[1,2,3]",),
           tests=("tests/test_eagle3.py", "tests/test_speculators_export.py")),
    Method("dflash", "DFlash", "drafter", module="drafters/dflash.py", proposer="dflash", in_method_table=True,
           formats=("draftsmith", "dflash-zlab", "speculators", "gguf"),
           tiny_overrides=("drafter.target_layers=[1,2,3]", "drafter.block_size=4"),
           tests=("tests/test_dflash.py", "tests/test_dflash_runtime.py")),
    Method("kangaroo", "Kangaroo", "self-speculative", module="drafters/kangaroo.py", proposer="kangaroo",
           in_method_table=True, tests=("tests/test_kangaroo.py",)),
    Method("specdecpp", "SpecDec++", "controller", module="controllers/acceptance.py", proposer="specdecpp",
           needs_input="drafter=EXPORT", tests=("tests/test_specdecpp.py", "tests/test_specdecpp_stop_rule.py")),
    Method("adaptive_temperature", "Adaptive temperature (LPO)", "controller",
           module="controllers/adaptive_temperature.py", proposer=CONTROLLER, needs_input="rollouts",
           tests=("tests/test_lpo_controller.py", "tests/test_lpo_loss.py", "tests/test_lpo_rollouts.py")),
    Method("learn2pd", "Learn2PD", "controller", module="controllers/learn2pd.py", proposer=CONTROLLER,
           needs_input="trajectories", tests=("tests/test_diffusion_learn2pd.py", "tests/test_diffusion_decode.py")),
    Method("diffusion_adapt", "Diffusion adaptation", "target-adaptation",
           module="recipes/diffusion_adapt/objective.py", proposer=None, needs_input="makes a target, not a drafter",
           tests=("tests/test_diffusion_adapt.py", "tests/test_diffusion_mask.py")),
)}


def register_method(method: Method) -> Method:
    """Add ``method`` to :data:`METHODS` (a method living outside this file: a plugin, the toy of
    ``tests/toy_method``); a name already there is an error. Returns it."""
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is already in the method table")
    METHODS[method.name] = method
    return method


def unregister_method(name: str) -> None:
    """Remove ``name`` from :data:`METHODS` (tests registering throwaway methods)."""
    del METHODS[name]


def get_method(name: str) -> Method:
    """The entry of ``name``; an unknown name lists the known ones."""
    if name not in METHODS:
        raise KeyError(f"method {name!r} is not in the method table (common/methods.py); known: "
                       f"{', '.join(sorted(METHODS))}")
    return METHODS[name]


def export_formats() -> list[str]:
    """Every ``export --format`` value some method supports, sorted (the CLI's choices)."""
    return sorted({f for m in METHODS.values() for f in m.formats})


def formats_of(method: str) -> tuple[str, ...]:
    """The export formats of the method whose export ``method`` key (or recipe name) is ``method``."""
    return get_method(method).formats


def method_table_recipes() -> list[str]:
    """Recipes the equal-budget method table trains by default, in table order."""
    return [m.name for m in METHODS.values() if m.in_method_table]


def labels() -> dict[str, str]:
    """Recipe name -> display label (tables, plots)."""
    return {m.name: m.label for m in METHODS.values()}


def method_problems(method: Method, root: str | Path, proposers: Collection[str]) -> list[str]:
    """What is missing for ``method``: its config, module or test files under ``root``, or (``proposers``: the export
    methods the runtime has proposers for) the runtime proposer it declares. Empty when complete."""
    root = Path(root)
    problems = [f"{method.name}: {what} {path} does not exist"
                for what, paths in (("config", (method.config,)), ("module", (method.module,)), ("test", method.tests))
                for path in paths if not (root / path).is_file()]
    if not method.tests:
        problems.append(f"{method.name}: no test files listed")
    if method.proposer not in (None, CONTROLLER) and method.proposer not in proposers:
        problems.append(f"{method.name}: no runtime proposer registered for export method {method.proposer!r}")
    return problems
