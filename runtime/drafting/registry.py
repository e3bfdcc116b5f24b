"""One registry of proposer families: each family module registers a builder for every export
``method`` it serves (``@register_proposer(method)``), and :func:`load_families` imports every
family module on first use.

The lookup is the registrations themselves: an export's ``config.json`` names its ``method`` (the
only key older exports carry), and the builder registered for it loads the proposer. A recipe
declares which method serves its exports (recipes/<name>/__init__.py, ``proposer=``);
tests/test_method_table.py checks every declared one is registered here. Adding a family adds its
module and its name to the import in :func:`load_families`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftsmith.common.errors import InputError
from draftsmith.common.registry import Registry
from draftsmith.export.schema import add_method_source

if TYPE_CHECKING:
    from draftsmith.runtime.drafting.base import Proposer
    from draftsmith.runtime.target.interface import TargetDecoder

ProposerBuilder = Callable[..., "Proposer"]
# chain(tokens) -> the builder options for a chain of at most ``tokens`` drafted tokens (see
# register_chain)
ChainOptions = Callable[[int], dict[str, Any]]

_REGISTRY: Registry[ProposerBuilder] = Registry("runtime proposer for method")
# @register_proposer(method) on builder(export_dir, config, target_model, **options) -> Proposer
register_proposer = _REGISTRY.register
_CHAINS: Registry[ChainOptions] = Registry("chain-drafting proposer for method")
# @register_chain(method) on chain(tokens) -> options: the method's proposer can draft a plain
# chain, on which SpecDec++ and its calibration stack a stop rule; the family says how its builder
# is asked for one.
register_chain = _CHAINS.register


# The proposer family modules (runtime/drafting/<name>.py); each registers its builders on import.
FAMILY_MODULES = (
    "clover",
    "dflash",
    "eagle",
    "hydra",
    "kangaroo",
    "medusa",
    "specdecpp",
)


def load_families() -> None:
    """Import every family module: each registers a builder for the export methods it serves."""
    for family in FAMILY_MODULES:
        importlib.import_module(f"draftsmith.runtime.drafting.{family}")


def proposer_module(method: str) -> str:
    """The module that registers the builder for ``method`` (docs/tools/method_footprint.py names
    it)."""
    load_families()
    return _REGISTRY.get(method).__module__


def registered_methods() -> list[str]:
    """Export methods the runtime can draft with."""
    load_families()
    return list(_REGISTRY)


add_method_source(
    registered_methods
)  # an export of a method served here reads, with or without an Exportable


def chain_options(export_dir: str | Path, tokens: int) -> dict[str, Any]:
    """Builder options that make the proposer of ``export_dir`` draft a chain of at most ``tokens``
    tokens; ValueError for a method whose proposer drafts no chain."""
    from draftsmith.export.format import read_config

    method = read_config(export_dir)["method"]
    load_families()
    if method not in _CHAINS:
        raise InputError(
            f"the {method!r} proposer of {export_dir} drafts no chain; chain drafters: "
            f"{', '.join(_CHAINS) or 'none'}"
        )
    return _CHAINS.get(method)(int(tokens))


def builder_options(builder: ProposerBuilder) -> tuple[str, ...] | None:
    """The option names a builder takes after ``(export_dir, config, target_model)``; None when it
    takes any (``**options``: it checks them itself). A ``**_`` catch-all ignores what it is given,
    so it adds no valid name.
    """
    params = list(inspect.signature(builder).parameters.values())[3:]
    if any(p.kind is p.VAR_KEYWORD and not p.name.startswith("_") for p in params):
        return None
    return tuple(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))


def check_options(method: str, builder: ProposerBuilder, options: dict[str, Any]) -> None:
    """Refuse (one line) option names the ``method`` proposer does not take, listing the ones it
    does."""
    valid = builder_options(builder)
    unknown = sorted(set(options) - set(valid)) if valid is not None else []
    if unknown:
        raise InputError(
            f"unknown --proposer-option {', '.join(unknown)} for the {method} proposer; valid: "
            f"{', '.join(valid) or 'none'}"
        )


def build_proposer(
    export_dir: str | Path,
    target_model: TargetDecoder,
    identity: dict | None = None,
    given: str | None = None,
    **options: Any,
) -> Proposer:
    """Load the proposer of an export folder for ``target_model`` (its method picks the builder).

    Every method is checked against the target first (:func:`check_target_model`): ``identity`` adds
    the tokenizer fingerprint, ``given`` names the target the user passed in the error message.
    Unknown ``options`` are refused with the list of valid ones before anything loads.
    """
    from draftsmith.export.format import read_config
    from draftsmith.runtime.drafting.base import Proposer

    config = read_config(export_dir)
    method = config["method"]
    load_families()
    if method not in _REGISTRY:
        raise InputError(
            f"no runtime proposer for method {method!r} (export {export_dir}); available: "
            f"{', '.join(registered_methods()) or 'none'}"
        )
    builder = _REGISTRY.get(method)
    check_options(method, builder, options)
    check_target_model(config, target_model, identity, given)
    proposer = builder(export_dir, config, target_model, **options)
    if not isinstance(proposer, Proposer):
        raise TypeError(
            f"the {method!r} builder returned a {type(proposer).__name__}, which does not subclass"
            " draftsmith.runtime.drafting.base.Proposer (the declared proposer interface):"
            " subclass it"
        )
    return proposer


def check_target_model(
    config: dict,
    target_model: TargetDecoder,
    identity: dict | None = None,
    given: str | None = None,
) -> None:
    """Raise ``TargetMismatchError`` unless ``target_model`` is the target the export ``config``
    records.

    Compares what the decoder itself shows (sizes, LM-head digest) with the record; ``identity``
    (the full :func:`~draftsmith.export.identity.target_identity` of this model, tokenizer included)
    is checked too when given, and then its LM-head digest stands for the model's (no second hash).
    """
    from draftsmith.export.identity import decoder_identity
    from draftsmith.export.target_check import check_target

    if identity is not None:
        check_target(config, identity, given)
    sizes = target_model.sizes
    recorded = config.get("target", {})
    name = given if given is not None else recorded.get("name_or_path", "the loaded target")
    seen = decoder_identity(
        name,
        sizes.hidden_size,
        sizes.num_layers,
        target_model.lm_head_weight,
        digest=identity is None or "lm_head" not in identity,
    )
    # Compare only what the export records: a hand-written export may record nothing but a name.
    shown = {k: v for k, v in seen.items() if k == "name_or_path" or k in recorded}
    if identity is not None and identity.get(
        "adapter"
    ):  # an adapter merged at load (checked above in full)
        shown["adapter"] = identity["adapter"]
    check_target(config, shown, given)
