"""The one write rule: no command writes over a file or folder it did not create, nor into, over or
around what it reads. Every output path a command is given is checked here before any work (one
line, :class:`OutputRefused`), then written the atomic way (:mod:`draftsmith.common.atomic_folder`,
which re-exports these names):

* :func:`refuse_overlap`: an output that is an input, lies inside one, or (a folder replaced whole)
  holds one;
* :func:`check_folder_target`: an output folder must be new, empty, or a draftsmith output of its
  :class:`OutputKind` holding only files that kind writes;
* :func:`check_output_file`: an output file must be new (or ``--overwrite``, or one the writer
  recognises as its own);
* :func:`check_writable`: the place must be writable (not under a file, not on a read-only file
  system);
* :func:`run_folder_problem`: a training command line's ``hydra.run.dir``, before Hydra makes it.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.common.errors import DraftsmithError


class OutputRefused(DraftsmithError, ValueError):
    """An output path holds something draftsmith did not write (or the source being converted):
    nothing written."""


@dataclass(frozen=True)
class OutputKind:
    """A kind of folder draftsmith writes: ``name`` (in messages), ``recognize(folder)`` (True for a
    folder of this kind) and ``files``: the glob patterns (relative paths, ``/``-separated) of every
    file the kind ever writes.
    """

    name: str
    recognize: Callable[[Path], bool]
    files: tuple[str, ...] = field(default=("*",))

    def foreign_files(self, folder: Path) -> list[str]:
        """Relative paths under ``folder`` that no writer of this kind makes (sorted)."""
        found = (p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir())
        return sorted(
            f for f in found if not any(fnmatch.fnmatch(f, pattern) for pattern in self.files)
        )


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def refuse_overlap(
    out_arg: str | Path,
    inputs: Iterable[str | Path | None],
    flag: str = "--out",
    what: str = "input",
    containing: bool = True,
) -> Path:
    """Refuse (:class:`OutputRefused`) an output path that is one of ``inputs``, lies inside one
    (writing into a model or export folder), or (``containing``) holds one (a folder replaced whole
    would take the input with it). Returns the output resolved."""
    out = Path(out_arg).expanduser().resolve()
    for given in filter(None, inputs):
        src = Path(given).expanduser().resolve()
        how = (
            "is the"
            if src == out
            else (
                "is inside the"
                if _inside(out, src)
                else "is a folder holding the"
                if containing and _inside(src, out)
                else None
            )
        )
        if how:
            raise OutputRefused(
                f"{flag} {out_arg} {how} {what} {given}: writing there would replace or change what"
                f" is being read; nothing was written; choose another {flag}"
            )
    return out


def check_writable(out: str | Path, flag: str = "--out") -> Path:
    """Refuse (:class:`OutputRefused`) a path whose nearest existing ancestor is a file or cannot be
    written (a read-only file system, no permission): before the work, not after it. Creates
    nothing; returns it resolved.
    """
    path = Path(out).expanduser().resolve()
    ancestor = next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())
    if ancestor != path and not ancestor.is_dir():
        raise OutputRefused(
            f"{flag} {out} cannot be written: {ancestor} is a file, not a folder; nothing was "
            f"written; choose another {flag}"
        )
    folder = ancestor if ancestor.is_dir() else ancestor.parent
    if not os.access(folder, os.W_OK | os.X_OK):
        why = "a read-only file system" if _read_only(folder) else "no write permission"
        raise OutputRefused(
            f"{flag} {out} cannot be written: {folder} is on {why}; nothing was written; choose "
            f"another {flag}"
        )
    return path


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_folder_target(
    out_dir: str | Path,
    kind: OutputKind,
    sources: Iterable[str | Path | None] = (),
    flag: str = "--out",
) -> Path:
    """Refuse (:class:`OutputRefused`, one line) an ``out_dir`` that :func:`write_folder` must not
    replace (a file, one of ``sources`` or a folder around or inside one, a folder that is not a
    ``kind`` output or holds files the kind never writes, a place that cannot be written); returns
    it resolved. Call it before long work so a bad ``--out`` fails at the start."""
    out = refuse_overlap(out_dir, sources, flag, what="source")
    if out.is_file() or out.is_symlink():
        raise OutputRefused(
            f"{flag} {out_dir} is a file, not a folder: nothing was written; choose another {flag}"
        )
    check_writable(out_dir, flag)
    if not out.is_dir() or not any(out.iterdir()):
        return out
    if not kind.recognize(out):
        shown = ", ".join(sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())[:4])
        raise OutputRefused(
            f"{flag} {out_dir} exists and is not a draftsmith {kind.name} (it holds {shown}): "
            "nothing was written or deleted; choose a new folder, or move its files out first"
        )
    foreign = kind.foreign_files(out)
    if foreign:
        raise OutputRefused(
            f"{flag} {out_dir} is a draftsmith {kind.name} but also holds files draftsmith did not "
            f"write ({', '.join(foreign[:4])}): nothing was replaced; move them out or choose "
            "another folder"
        )
    return out


def check_output_file(
    path: str | Path,
    inputs: Iterable[str | Path | None] = (),
    overwrite: bool = False,
    flag: str = "--out",
    owned: Callable[[Path], bool] | None = None,
) -> Path:
    """The write rule for a single output file (``regenerate --out X.jsonl``): refused when it is
    one of ``inputs`` or inside one, a folder, an existing file draftsmith cannot tell it wrote
    (``owned``; without ``overwrite``), or under a place that cannot be written. Returns it
    resolved."""
    out = refuse_overlap(path, inputs, flag, containing=False)
    if out.is_dir():
        raise OutputRefused(
            f"{flag} {path} is a folder; it names the output file: nothing was written; pass a file"
            f" path (e.g. {Path(path) / 'out.jsonl'})"
        )
    if out.exists() and not overwrite and not (owned is not None and owned(out)):
        raise OutputRefused(
            f"{flag} {path} exists: nothing was written or replaced; choose another {flag}, or pass"
            " --overwrite to replace it"
        )
    return check_writable(path, flag)


RUN_FOLDER_MARKS = (".hydra", "checkpoints", "logs", "export")


def run_folder_problem(overrides: Iterable[str]) -> str | None:
    """Why the ``hydra.run.dir=DIR`` of a training command line cannot be its run folder (a file, a
    place that cannot be written, the data or target or inside them, a folder of the user's that is
    not a run folder), else None. Checked before Hydra makes the folder: a training run resumes only
    in a folder it wrote.
    """
    values = {k.lstrip("+"): v for k, _, v in (o.partition("=") for o in overrides)}
    given = values.get("hydra.run.dir")
    if not given:
        return None
    inputs = [
        values.get(k)
        for k in ("data.spec", "target.name_or_path", "data", "target", "data.features")
    ]
    try:
        out = refuse_overlap(given, [i for i in inputs if i and Path(i).exists()], "hydra.run.dir")
        if out.exists() and not out.is_dir():
            raise OutputRefused(
                f"hydra.run.dir {given} is a file, not a folder: nothing was written; choose"
                " another hydra.run.dir"
            )
        check_writable(given, "hydra.run.dir")
    except OutputRefused as err:
        return str(err)
    if (
        out.is_dir()
        and any(out.iterdir())
        and not any((out / m).exists() for m in RUN_FOLDER_MARKS)
    ):
        shown = ", ".join(sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())[:4])
        return (
            f"hydra.run.dir {given} exists and is not a draftsmith run folder (it holds {shown}):"
            " nothing was written; choose a new folder (a run resumes only in a folder it wrote)"
        )
    return None


def check_file_target(path: str | Path, owned: Callable[[Path], bool] | None = None) -> Path:
    """Refuse (:class:`OutputRefused`) a ``path`` that is a folder, an existing file ``owned`` says
    draftsmith did not write, or one under a folder that cannot be written (its nearest existing
    ancestor is a file or read-only). Creates nothing, so a writer calls it before its work. Returns
    ``path`` resolved."""
    out = Path(path).expanduser().resolve()
    if out.is_dir():
        raise OutputRefused(f"{path} is a folder; a file was expected there: nothing was written")
    if out.exists() and owned is not None and not owned(out):
        raise OutputRefused(
            f"{path} exists and was not written by draftsmith: nothing was replaced; choose another"
            " name or move it away"
        )
    ancestor = next(p for p in out.parents if p.exists())
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputRefused(
            f"cannot write {path}: {ancestor} is"
            f" {'a file' if not ancestor.is_dir() else 'read-only'}; choose another place"
        )
    return out


__all__ = [
    "OutputKind",
    "OutputRefused",
    "RUN_FOLDER_MARKS",
    "check_file_target",
    "check_folder_target",
    "check_output_file",
    "check_writable",
    "refuse_overlap",
    "run_folder_problem",
]
