"""The schema of an export's ``config.json``, checked when it is read: a wrong type, an unknown
method or verifier, a weight part named outside the folder is one line naming the key
(``ExportSchemaError``), never a Python internal ("invalid literal for int()") from whichever reader
met it first.

Top level: ``format`` "draftsmith", ``format_version`` an integer, ``method`` a known method,
``architecture`` and ``target`` objects, ``inference`` / ``training`` / ``identity`` /
``base_export`` objects when present, ``parts`` an object of ``{name: {"file": "<name>.safetensors",
"tensors": n}}`` whose names are lower-case letters, digits and ``_`` and whose files lie in the
export folder itself. ``target``'s sizes are integers, its name and fingerprints strings. ``method``
is one some code in this process declares: an ``Exportable`` module's (any, wherever it is defined),
the adapted target's, or one a registered method source names (:func:`add_method_source`: the
runtime's proposer registry, the recipes' registrations, so a plugin method without an
``Exportable`` reads too). ``inference.verifier`` is one the runtime has,
``inference.stop_policy.kind`` one it runs, its numbers numbers; ``inference.tree`` a list of paths
of integers. The architecture's own fields are typed by the module's config dataclass when it is
rebuilt (:func:`check_field_types`, called by ``Exportable``).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from draftsmith.common.constants import STOP_POLICY_KINDS

# The verifiers the runtime registers (runtime/acceptance/choice.py VERIFIERS;
# tests/test_export_schema.py keeps the two lists equal: export/ may not import the runtime).
VERIFIER_NAMES = ("greedy", "rejection", "typical")
PART_NAME = re.compile(r"^[a-z0-9_]+$")
FIX = "restore the value the export was written with, or re-export the drafter"


def _kind(value: Any) -> str:
    return (
        "null"
        if value is None
        else {
            dict: "an object",
            list: "a list",
            str: "a string",
            bool: "a boolean",
            int: "an integer",
            float: "a number",
        }.get(type(value), type(value).__name__)
    )


def _is(value: Any, want: str) -> bool:
    """``want``: int | number | str | dict | list | bool."""
    if want == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if want == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"str": str, "dict": dict, "list": list, "bool": bool}[want])


def _need(where: str, key: str, value: Any, want: str, optional: bool = False) -> None:
    from draftsmith.export.format import ExportSchemaError

    if value is None and optional:
        return
    if not _is(value, want):
        names = {
            "int": "an integer",
            "number": "a number",
            "str": "a string",
            "dict": "an object",
            "list": "a list",
            "bool": "true or false",
        }
        raise ExportSchemaError(
            f"{where}: {key} must be {names[want]}, got {value!r} ({_kind(value)}); {FIX}"
        )


def _target(where: str, target: dict[str, Any]) -> None:
    _need(where, "target.name_or_path", target.get("name_or_path"), "str")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        _need(where, f"target.{key}", target.get(key), "int", optional=True)
    for key in ("fingerprint", "lm_head", "model_type"):
        _need(where, f"target.{key}", target.get(key), "str", optional=True)
    _need(where, "target.adapter", target.get("adapter"), "dict", optional=True)


def _inference(where: str, inference: dict[str, Any]) -> None:
    from draftsmith.export.format import ExportSchemaError

    verifier = inference.get("verifier")
    if verifier is not None and verifier not in VERIFIER_NAMES:
        raise ExportSchemaError(
            f"{where}: inference.verifier {verifier!r} is not a verifier the runtime has "
            f"({', '.join(VERIFIER_NAMES)}); {FIX}"
        )
    for key in ("depth", "top_k", "total_tokens"):
        _need(where, f"inference.{key}", inference.get(key), "int", optional=True)
    policy = inference.get("stop_policy")
    _need(where, "inference.stop_policy", policy, "dict", optional=True)
    if isinstance(policy, dict):
        if policy.get("kind") not in STOP_POLICY_KINDS:
            raise ExportSchemaError(
                f"{where}: inference.stop_policy.kind {policy.get('kind')!r} is not a stop policy "
                f"the runtime runs ({', '.join(STOP_POLICY_KINDS)}); {FIX}"
            )
        for key in ("threshold", "max_depth", "min_depth"):
            _need(where, f"inference.stop_policy.{key}", policy.get(key), "number", optional=True)
    tree = inference.get("tree")
    if tree is not None and not (
        isinstance(tree, list)
        and all(isinstance(p, list) and all(_is(c, "int") for c in p) for p in tree)
    ):
        raise ExportSchemaError(
            f"{where}: inference.tree must be a list of paths of integers (e.g. [[0], [1], [0, 0]]"
            f"), got {tree!r}; {FIX}"
        )


def _parts(where: str, parts: Any) -> None:
    from draftsmith.export.format import ExportSchemaError, part_file

    _need(where, "parts", parts, "dict")
    for name, entry in parts.items():
        if not PART_NAME.match(str(name)):
            raise ExportSchemaError(
                f"{where}: weight part {name!r} is not a part name (lower-case letters, digits, "
                f"'_'): a part's file lies in the export folder itself; {FIX}"
            )
        _need(where, f"parts.{name}", entry, "dict")
        file = entry.get("file", part_file(name))
        if file != part_file(name):
            raise ExportSchemaError(
                f"{where}: parts.{name}.file {file!r} is outside what the export folder holds "
                f"(part {name!r} is stored as {part_file(name)} beside config.json); {FIX}"
            )


def validate_config(config: Any, where: str | Path) -> dict[str, Any]:
    """``config`` (a parsed config.json) checked against the schema (module docstring); returns
    it."""
    from draftsmith.export.format import ExportSchemaError

    where = str(where)
    if not isinstance(config, dict):
        raise ExportSchemaError(
            f"{where} holds {_kind(config)}, not an object: it is not a draftsmith export "
            "config; re-export the drafter"
        )
    _need(where, "format_version", config.get("format_version", 1), "int")
    _need(where, "method", config.get("method"), "str")
    methods = known_methods()
    if config["method"] not in methods:
        raise ExportSchemaError(
            f"{where}: method {config['method']!r} is not a method draftsmith has ("
            f"{', '.join(sorted(methods))}); {FIX}"
        )
    for key in ("architecture", "target"):
        _need(where, key, config.get(key), "dict")
    for key in ("inference", "training", "identity", "base_export"):
        _need(where, key, config.get(key), "dict", optional=True)
    _target(where, config["target"])
    _inference(where, config.get("inference") or {})
    if "parts" in config:
        _parts(where, config["parts"])
    if (exportable := exportable_class(config["method"])) is not None:
        folder = Path(where).parent if Path(where).name == "config.json" else Path(where)
        check_architecture(exportable, config, folder)
    return config


# The one method whose export is not a module of heads/, drafters/ or controllers/: it writes an
# adapted target (recipes/diffusion_adapt), read by runtime/target/diffusion_lm.py; export/ may
# import neither.
TARGET_EXPORT_METHODS = ("diffusion_adapt",)
# Functions naming further export methods, added by the registries export/ may not import (the
# runtime's proposers, the recipes): read at each check, so a method registered (or unregistered)
# later is seen as it is then.
_METHOD_SOURCES: list[Callable[[], Iterable[str]]] = []


def add_method_source(source: Callable[[], Iterable[str]]) -> None:
    """Make the export methods ``source()`` names known methods (runtime/drafting/registry.py adds
    its registered proposers, recipes/registration.py its recipes' ``proposer`` methods)."""
    if source not in _METHOD_SOURCES:
        _METHOD_SOURCES.append(source)


def _exportable_classes() -> dict[str, type]:
    """Export method -> the ``Exportable`` class that rebuilds it, from every ``Exportable``
    subclass defined (each declares its ``method`` and the older names it ``also_loads``): no
    hand-kept table. heads/, drafters/ and controllers/ are imported first; their classes win over a
    same-named one defined elsewhere (a test's, a plugin's)."""
    from draftsmith.export.exportable import Exportable

    for package in ("heads", "drafters", "controllers"):
        root = importlib.import_module(f"draftsmith.{package}")
        for info in pkgutil.iter_modules(root.__path__):
            importlib.import_module(f"draftsmith.{package}.{info.name}")
    classes: list[type] = []
    pending = list(Exportable.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        classes.append(cls)
    found: dict[str, type] = {}
    for cls in sorted(
        classes, key=lambda c: not c.__module__.startswith("draftsmith.")
    ):  # stable: ours first
        for method in (getattr(cls, "method", None), *getattr(cls, "also_loads", ())):
            if isinstance(method, str) and method:
                found.setdefault(method, cls)
    return found


def known_methods() -> tuple[str, ...]:
    """Every export ``method`` draftsmith reads: its exportable modules', the adapted target's and
    the ones the method sources name."""
    declared = [method for source in _METHOD_SOURCES for method in source()]
    return tuple(dict.fromkeys([*_exportable_classes(), *TARGET_EXPORT_METHODS, *declared]))


def exportable_class(method: str) -> type | None:
    """The ``Exportable`` class that rebuilds ``method``'s exports, so every reader of an export
    gets its architecture checked (:func:`check_architecture`); None for a method without one (the
    adapted target, a plugin's).
    """
    return _exportable_classes().get(method)


# What an architecture the method's module cannot take means, and what to do about it.
RELABEL_FIX = (
    "if config.json's 'method' was edited, restore the method the export was written with; else"
    " re-export the drafter with this draftsmith"
)


def relabel_claim(export_dir: str | Path, config: dict[str, Any]) -> str:
    """The start of a message about an architecture that does not fit the method ``config``
    claims."""
    return f"{export_dir} claims method {config.get('method')!r}, but its architecture"


def check_architecture(exportable: type, config: dict[str, Any], export_dir: str | Path) -> None:
    """Refuse (``ExportSchemaError``, one line) an architecture ``exportable`` cannot rebuild:
    fields its ``config_class`` does not know (unless it ignores extra keys: the method was edited,
    or another draftsmith wrote it), checked first since it names the cause, then fields of the
    wrong type."""
    from draftsmith.export.format import ExportSchemaError

    config_class = exportable.config_class
    arch = config.get("architecture") or {}
    unknown = sorted(set(arch) - {f.name for f in dataclasses.fields(config_class)})
    if unknown and not getattr(exportable, "extra_architecture_keys", False):
        written_as = (
            (config.get("identity") or {}).get("method")
            if isinstance(config.get("identity"), dict)
            else None
        )
        fix = (
            f'it was written as a {written_as!r} export: restore "method": "{written_as}"'
            if written_as and written_as != config.get("method")
            else RELABEL_FIX
        )
        raise ExportSchemaError(
            f"{relabel_claim(export_dir, config)} fields {unknown} are unknown to "
            f"{config_class.__name__}; {fix}"
        )
    check_field_types(config_class, arch, Path(export_dir) / "config.json")


def _accepts(value: Any, hint: Any) -> bool:
    """Whether a JSON value can stand for a dataclass field typed ``hint``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return _is(value, "int")
    if hint is float:
        return _is(value, "number")
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple) or hint in (list, tuple):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return (
            isinstance(value, (list, tuple)) and all(_accepts(v, args[0]) for v in value)
            if args
            else isinstance(value, (list, tuple))
        )
    return True  # dicts and other types: the module's own checks


def check_field_types(config_class: type, fields: dict[str, Any], where: str | Path) -> None:
    """Refuse (``ExportSchemaError`` naming ``architecture.KEY``) a field of the architecture whose
    JSON value cannot be the type ``config_class`` declares for it (``"two"`` for an integer, a list
    for a number).
    """
    from draftsmith.export.format import ExportSchemaError

    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        if field.name in fields and not _accepts(fields[field.name], hints.get(field.name, Any)):
            raise ExportSchemaError(
                f"{where}: architecture.{field.name} must be {_type_name(hints[field.name])}, "
                f"got {fields[field.name]!r} ({_kind(fields[field.name])}); {FIX}"
            )


def _type_name(hint: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return names.get(hint, str(hint).replace("typing.", ""))


__all__ = [
    "VERIFIER_NAMES",
    "add_method_source",
    "check_architecture",
    "check_field_types",
    "known_methods",
    "validate_config",
]
