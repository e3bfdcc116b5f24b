"""One row of the fault sweep's case table, and the setup steps a row may ask for before its command
runs.

A command is a string with placeholders: the world's inputs (``{T}``, ``{MED}``... see world.py) and
``{S}``, the case's own scratch folder. It starts with ``ds`` (the ``draftsmith`` CLI) or ``train``
(``train.py``). Setup steps are tuples run in order (paths formatted the same way):

* ``("file", PATH, TEXT)`` / ``("bytes", PATH, HEX)`` / ``("dir", PATH)``: make a file or folder;
* ``("copy", SRC, DST)``: copy a file or folder (a case damages its own copy, never the world's);
* ``("json", FILE, {"a.b": value})``: set keys (dotted paths; ``None`` deletes the key) in a JSON
  file;
* ``("nan", FILE)``: every floating tensor of a safetensors file set to NaN; ``("truncate", FILE,
  N)``: keep N bytes;
* ``("rm", PATH)``; ``("run", COMMAND)``: a command that must succeed (e.g. a first run a resume
  case resumes);
* ``("ro", DIR)`` / ``("full", DIR, KB)``: a read-only, or a KB-sized, tmpfs mounted at DIR (root
  only; the case is skipped elsewhere), unmounted after the case.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Case:
    """A fault case: ``cmd`` run after ``setup``; ``expect`` refuse | interrupt | ok; ``mentions``:
    what the one error line must name (case-insensitive); ``protect``: paths whose bytes must not
    change (``append:PATH``: may only grow); ``rerun``: a command that must succeed afterwards (else
    the state is wedged); ``owner``: who fixes it (C1 commands/exports, A config/train.py, B
    runtime/bench, C2 training-side faults, D engine, E evals).
    """

    id: str
    cmd: str
    expect: str = "refuse"
    mentions: tuple[str, ...] = ()
    setup: tuple[tuple[Any, ...], ...] = ()
    protect: tuple[str, ...] = ()
    rerun: str | None = None
    owner: str = "C1"
    timeout: int = 240
    stdin: str = ""
    # seconds after start; or after the first stderr line matching sigint_on
    sigint_after: float | None = None
    sigint_on: str | None = None
    env: dict[str, str] = field(default_factory=dict)


def c(id: str, cmd: str, *mentions: str, **kw: Any) -> Case:
    """A refusal case in one line: ``c("gen-no-target", "ds generate --target nosuch ...",
    "nosuch")``."""
    return Case(id, cmd, mentions=tuple(mentions), **kw)


def ok(id: str, cmd: str, **kw: Any) -> Case:
    """A control case: the command must work."""
    return Case(id, cmd, expect="ok", **kw)


def copy(src: str, dst: str) -> tuple[str, str, str]:
    return ("copy", src, dst)


def edit(path: str, changes: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    return ("json", path, changes)


def file(path: str, text: str = "keep me\n") -> tuple[str, str, str]:
    return ("file", path, text)


__all__ = ["Case", "c", "copy", "edit", "file", "ok"]
