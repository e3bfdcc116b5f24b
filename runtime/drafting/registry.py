"""One registry of proposer families, found by what each family declares.

A family is a module of this package that states the export methods it serves in one module-level line,
``SERVES = ("medusa", "medusa2")``, and registers a builder for each (``@register_proposer(method)``). The line is
read without importing anything (``ast``), so serving one export imports its own family alone; adding a family adds
a file and no line to any list. ``tests/test_proposer_contract.py`` fails for a family that registers a method its
``SERVES`` does not name, or names one it does not register.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftsmith.common.errors import InputError
from draftsmith.common.registry import Registry

if TYPE_CHECKING:
    from draftsmith.runtime.drafting.base import Proposer

PACKAGE = "draftsmith.runtime.drafting"
DECLARATION = "SERVES"  # the module-level tuple of export methods a family module serves

ProposerBuilder = Callable[..., "Proposer"]
# chain(tokens) -> the builder options for a chain of at most ``tokens`` drafted tokens (see register_chain)
ChainOptions = Callable[[int], dict[str, Any]]

_REGISTRY: Registry[ProposerBuilder] = Registry("runtime proposer for method")
# @register_proposer(method) on builder(export_dir, config, target_model, **options) -> Proposer
register_proposer = _REGISTRY.register
_CHAINS: Registry[ChainOptions] = Registry("chain-drafting proposer for method")
# @register_chain(method) on chain(tokens) -> options: the method's proposer can draft a plain chain, on which
# SpecDec++ and its calibration stack a stop rule; the family says how its builder is asked for one.
register_chain = _CHAINS.register


def declared_families() -> dict[str, tuple[str, ...]]:
    """Module name -> the methods its ``SERVES`` line declares, for every module of this package that has one."""
    return dict(_declarations(str(Path(__file__).parent)))


@cache
def _declarations(folder: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    found = []
    for path in sorted(Path(folder).glob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            target = node.target if isinstance(node, ast.AnnAssign) else \
                node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
            if isinstance(target, ast.Name) and target.id == DECLARATION and node.value is not None:
                found.append((path.stem, tuple(str(m) for m in ast.literal_eval(node.value))))
    return tuple(found)


def load_family_of(method: str) -> None:
    """Import the family module whose ``SERVES`` names ``method`` (it registers the builder); every module of the
    package when none declares it (a family that registers without declaring still serves, and the contract test
    names it)."""
    if method in _REGISTRY:
        return
    for module, methods in declared_families().items():
        if method in methods:
            importlib.import_module(f"{PACKAGE}.{module}")
            return
    load_all_families()


def load_all_families() -> None:
    """Import every module of this package, which registers every family's builders."""
    for path in sorted(Path(__file__).parent.glob("*.py")):
        if path.stem != "__init__":
            importlib.import_module(f"{PACKAGE}.{path.stem}")


def registered_by_module() -> dict[str, set[str]]:
    """Module name (of this package) -> the methods its builders registered, after importing every family."""
    load_all_families()
    found: dict[str, set[str]] = {}
    for method in _REGISTRY:
        module = _REGISTRY.get(method).__module__
        if module.startswith(f"{PACKAGE}."):
            found.setdefault(module.rsplit(".", 1)[1], set()).add(method)
    return found


def declaration_problems(registered: dict[str, set[str]], declared: dict[str, tuple[str, ...]]) -> list[str]:
    """One line per family module whose registered methods and ``SERVES`` line disagree (empty: every family is
    found by its declaration)."""
    problems = []
    for module in sorted(set(registered) | set(declared)):
        got, said = registered.get(module, set()), set(declared.get(module, ()))
        if got - said:
            problems.append(f"runtime/drafting/{module}.py registers {', '.join(sorted(got - said))} but its "
                            f"{DECLARATION} line does not name it: add {DECLARATION} = {tuple(sorted(got | said))!r}")
        if said - got:
            problems.append(f"runtime/drafting/{module}.py declares {', '.join(sorted(said - got))} in "
                            f"{DECLARATION} but registers no builder for it")
    return problems


def registered_methods() -> list[str]:
    """Export methods the runtime can draft with."""
    load_all_families()
    return list(_REGISTRY)


def chain_options(export_dir: str | Path, tokens: int) -> dict[str, Any]:
    """Builder options that make the proposer of ``export_dir`` draft a chain of at most ``tokens`` tokens; ValueError
    for a method whose proposer drafts no chain."""
    from draftsmith.export.format import read_config

    method = read_config(export_dir)["method"]
    load_family_of(method)
    if method not in _CHAINS:
        raise InputError(f"the {method!r} proposer of {export_dir} drafts no chain; chain drafters: "
                         f"{', '.join(_CHAINS) or 'none'}")
    return _CHAINS.get(method)(int(tokens))


def builder_options(builder: ProposerBuilder) -> tuple[str, ...] | None:
    """The option names a builder takes after ``(export_dir, config, target_model)``; None when it takes any
    (``**options``: it checks them itself). A ``**_`` catch-all ignores what it is given, so it adds no valid name."""
    params = list(inspect.signature(builder).parameters.values())[3:]
    if any(p.kind is p.VAR_KEYWORD and not p.name.startswith("_") for p in params):
        return None
    return tuple(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))


def check_options(method: str, builder: ProposerBuilder, options: dict[str, Any]) -> None:
    """Refuse (one line) option names the ``method`` proposer does not take, listing the ones it does."""
    valid = builder_options(builder)
    unknown = sorted(set(options) - set(valid)) if valid is not None else []
    if unknown:
        raise InputError(f"unknown --proposer-option {', '.join(unknown)} for the {method} proposer; valid: "
                         f"{', '.join(valid) or 'none'}")


def build_proposer(export_dir: str | Path, target_model: Any, identity: dict | None = None, given: str | None = None,
                   **options: Any) -> Proposer:
    """Load the proposer of an export folder for ``target_model`` (its method picks the builder).

    Every method is checked against the target first (:func:`check_target_model`): ``identity`` adds the tokenizer
    fingerprint, ``given`` names the target the user passed in the error message. Unknown ``options`` are refused
    with the list of valid ones before anything loads.
    """
    from draftsmith.export.format import read_config
    from draftsmith.runtime.drafting.base import Proposer

    config = read_config(export_dir)
    method = config["method"]
    load_family_of(method)
    if method not in _REGISTRY:
        raise InputError(f"no runtime proposer for method {method!r} (export {export_dir}); available: "
                         f"{', '.join(registered_methods()) or 'none'}")
    builder = _REGISTRY.get(method)
    check_options(method, builder, options)
    check_target_model(config, target_model, identity, given)
    proposer = builder(export_dir, config, target_model, **options)
    if not isinstance(proposer, Proposer):
        raise TypeError(f"the {method!r} builder returned a {type(proposer).__name__}, which does not subclass "
                        "draftsmith.runtime.drafting.base.Proposer (the declared proposer interface): subclass it")
    return proposer


def check_target_model(config: dict, target_model: Any, identity: dict | None = None, given: str | None = None) -> None:
    """Raise ``TargetMismatchError`` unless ``target_model`` is the target the export ``config`` records.

    Compares what the decoder itself shows (sizes, LM-head digest) with the record; ``identity`` (the full
    :func:`~draftsmith.export.identity.target_identity` of this model, tokenizer included) is checked too when
    given, and then its LM-head digest stands for the model's (no second hash).
    """
    from draftsmith.export.format import check_target
    from draftsmith.export.identity import decoder_identity

    if identity is not None:
        check_target(config, identity, given)
    cfg = getattr(target_model, "config", None)
    layers = getattr(cfg, "num_layers", getattr(cfg, "num_hidden_layers", None))  # lean | HF config
    recorded = config.get("target", {})
    name = given if given is not None else recorded.get("name_or_path", "the loaded target")
    seen = decoder_identity(name, getattr(cfg, "hidden_size", None), layers,
                            getattr(target_model, "lm_head_weight", None),
                            digest=identity is None or "lm_head" not in identity)
    # Compare only what the export records: a hand-written export may record nothing but a name.
    shown = {k: v for k, v in seen.items() if k == "name_or_path" or k in recorded}
    if identity is not None and identity.get("adapter"):  # an adapter merged at load (checked above in full)
        shown["adapter"] = identity["adapter"]
    check_target(config, shown, given)
