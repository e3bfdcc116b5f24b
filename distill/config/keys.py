"""How a config key is declared: :func:`key` (its type comes from the annotation; its one-line doc,
default and allowed range are the field's metadata) and :func:`group` (a nested group of keys).
The shared groups are in :mod:`.schema`, each recipe's own beside its schema
(``recipes/<name>/__init__.py``); :mod:`.checks` reads the metadata for the ranges and for
``train.py --help``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from typing import Any

from omegaconf import MISSING


def key(
    doc: str,
    default: Any = MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: tuple[str, ...] | None = None,
    length: int | None = None,
    null: str | None = None,
    check: Callable[[Any], bool] | None = None,
    allowed: str | None = None,
) -> Any:
    """A config field: ``doc`` (one line, shown by ``--help``), its ``default`` (the value; a list
    is copied per instance) and its allowed range, checked before anything loads: bounds
    (``ge``/``gt``/``le``/``lt``, on each element of a list), ``choices`` (compared
    case-insensitively as text), ``length`` (of a list), ``null`` (what null means, for a key that
    may be null), or a ``check`` predicate for what those cannot say, described by ``allowed``."""
    rules = {
        name: value
        for name, value in (
            ("ge", ge),
            ("gt", gt),
            ("le", le),
            ("lt", lt),
            ("choices", choices),
            ("length", length),
            ("null", null),
            ("check", check),
            ("allowed", allowed),
        )
        if value is not None
    }
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc, **rules})
    return field(default=default, metadata={"doc": doc, **rules})


def group(cls: type, **values: Any) -> Any:
    """A nested group field (its keys come from ``cls``); ``values`` replace some of its defaults
    for this schema."""
    return field(default_factory=lambda: cls(**values))
