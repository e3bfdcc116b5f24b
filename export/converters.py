"""The export formats: each converter module declares its own, and ``draftsmith export --format``
reads them here.

A format is one :class:`ExportFormat`: its ``name`` (the ``--format`` value), the export ``methods``
it converts, its ``convert(request) -> Path`` and a one-line ``help``; optionally
``add_arguments(parser)`` for flags of its own (gguf's ``--quantize``). Registering a format is a
module of this package, named in :data:`CONVERTER_MODULES`, that ends with

    register_format(ExportFormat("myformat", methods=("eagle3",), convert=_convert_request,
                                 help="MyEngine's layout: myengine serve OUT"))

where ``_convert_request(request: ConvertRequest) -> Path`` writes ``request.out`` (through
:func:`draftsmith.export.format.atomic_folder_write` with ``sources=request.sources``, so a layout
never lands on the user's folder or on its own source) and returns it. What only the caller can do
(resolve the target folder the export names, read its LM head, find the llama.cpp build) comes in
``request.host`` (:class:`ConverterHost`), so converters import neither the runtime nor bench/.
Import optional packages (an engine's own library) inside the convert
function: a module that fails to import for want of one is skipped with a warning. ``draftsmith``
itself (a run folder or checkpoint -> export) is not a converter. The CLI's ``--format`` choices are
these declarations; a recipe names the formats its exports convert to (``formats=`` of its
registration, recipes/<name>/__init__.py), and tests/test_method_table.py checks that each is
declared here and holds the recipe's method.
"""

from __future__ import annotations

import argparse
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from draftsmith.common.errors import InputError
from draftsmith.common.registry import Registry

log = logging.getLogger(__name__)

NATIVE_FORMAT = "draftsmith"  # the export itself: every method has it, no converter writes it


class ConverterHost(Protocol):
    """What a converter may ask of its caller (the CLI implements it)."""

    def verifier_folder(self, config: dict[str, Any], target: str | None) -> str:
        """The target the converted layout names: ``target`` or the export's record, checked against
        its identity."""

    def lm_head(self, folder: str) -> Any:
        """The LM head weight [V, H] of the target folder ``folder``."""

    def llamacpp(self, target_folder: str) -> tuple[Path, Path | None]:
        """``(root of the llama.cpp build, cached BF16 GGUF of target_folder or None)``; raises when
        there is none."""


@dataclass
class ConvertRequest:
    """One conversion: the draftsmith ``export_dir`` (maybe a temporary export of the user's run
    folder), the ``out`` folder, the export's ``config``, ``source`` (what the user named, for
    messages and provenance), ``target`` (``--target`` or None), ``options`` (the format's own flags
    by dest name) and the ``host``."""

    export_dir: Path
    out: Path
    config: dict[str, Any]
    source: str
    target: str | None
    host: ConverterHost
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def sources(self) -> tuple[Path, ...]:
        """The folders the output must not replace: the export converted and what the user named."""
        return (Path(self.export_dir), Path(self.source))

    def verifier_folder(self) -> str:
        """``host.verifier_folder`` of this request's config and ``--target``."""
        return self.host.verifier_folder(self.config, self.target)


@dataclass(frozen=True)
class ExportFormat:
    """One ``--format`` value, declared by its converter module (module docstring)."""

    name: str
    methods: tuple[str, ...]
    convert: Callable[[ConvertRequest], Path]
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    refusal_hint: str = ""  # appended to the one-line refusal of a method this format does not hold

    def holds(self, method: str) -> bool:
        """Whether exports of ``method`` convert to this format."""
        return method in self.methods


FORMATS: Registry[ExportFormat] = Registry("export format")
# The modules of this package that declare formats (importing one registers them); a new converter
# adds its name.
CONVERTER_MODULES = ("dflash", "gguf", "medusa_layout", "medusa_tgi", "sglang", "speculators")
_loaded = False


def register_format(fmt: ExportFormat) -> ExportFormat:
    """Declare ``fmt`` (at the end of its converter module); a name registered twice is an error."""
    if fmt.name == NATIVE_FORMAT:
        raise ValueError(f"{NATIVE_FORMAT!r} is the export itself, not a converter format")
    return FORMATS.register(fmt.name)(fmt)


def _load_converters() -> None:
    """Import the modules of :data:`CONVERTER_MODULES` once: each registers its formats on
    import."""
    global _loaded
    if _loaded:
        return
    for module in CONVERTER_MODULES:
        name = f"{__package__}.{module}"
        try:
            importlib.import_module(name)
        # an optional package one converter needs must not take the others down
        except ModuleNotFoundError as err:
            if (err.name or "").startswith("draftsmith"):
                raise
            log.warning(
                "export formats of %s are unavailable: it needs %s, which is not installed (import"
                " optional packages inside the convert function)",
                name,
                err.name,
            )
    _loaded = True


def converters() -> dict[str, ExportFormat]:
    """Every registered format by name (sorted)."""
    _load_converters()
    return {name: FORMATS.get(name) for name in FORMATS}


def get_format(name: str) -> ExportFormat:
    """The format ``name``; an unknown one lists the valid values."""
    found = converters().get(name)
    if found is None:
        raise InputError(f"unknown --format {name!r}; valid: {', '.join(export_formats())}")
    return found


def export_formats() -> list[str]:
    """Every ``--format`` value (the CLI's choices): ``draftsmith`` and the registered formats,
    sorted."""
    return sorted({NATIVE_FORMAT, *converters()})


def formats_for(method: str) -> list[str]:
    """The ``--format`` values exports of ``method`` convert to: ``draftsmith`` first, then the
    formats that hold it, sorted."""
    return [NATIVE_FORMAT, *(name for name, fmt in converters().items() if fmt.holds(method))]
