"""One write discipline for every folder and file draftsmith writes: beside, then swapped in; never over the user's.

Folders (exports, converted engine layouts, bench output folders): :func:`write_folder` fills a sibling temporary
folder ``.<name>.tmp-<pid>-<random>`` and renames it into place. Before anything is written it refuses, in one line
(:class:`OutputRefused`), to replace

* a path that is a file, or a folder that is not a draftsmith output of the same :class:`OutputKind` (the user's
  ``keep.txt`` and ``sub/keep.txt`` stay where they are);
* an output of that kind that also holds files the kind never writes (the user's notes inside an old export);
* one of its own ``sources`` (a converted layout written over the export it was converted from).

Files (``bench.json``, ``bench.md``, reports): :func:`write_file` writes ``.<name>.tmp-<pid>-<random>`` beside
the file, fsyncs and renames it over the old one. A writer (bench/, reports) calls it as::

    from draftsmith.common.atomic_folder import write_file
    write_file(out / "bench.json", json.dumps(result, indent=2) + "\\n")          # text or bytes
    write_file(out / "plot.png", lambda tmp: fig.savefig(tmp, format="png"))     # or a callable writing tmp

and calls :func:`check_folder_target` (or :func:`check_file_target`) at its start, so an output that cannot be
written fails before the work, not after it. Declaring a folder kind is one :class:`OutputKind` (its name, how to
recognise one, the file patterns it writes), e.g. ``OutputKind("bench output", lambda f: (f / "bench.json").is_file(),
("bench.json", "bench.md", "*.png"))``.

A full disk (ENOSPC, or EDQUOT on a quota) during either write removes the temporary and raises
:class:`DiskFullError`, one line naming the path, the space needed and the space free. Temporaries left by an
earlier process that died (its pid is gone) are removed at the next write of the same name, with a warning; a
folder caught between the two renames of a swap (``.<name>.old-<pid>``) is put back.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.common.errors import DraftsmithError

log = logging.getLogger(__name__)

FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class OutputRefused(DraftsmithError, ValueError):
    """An output path holds something draftsmith did not write (or the source being converted): nothing written."""


class DiskFullError(DraftsmithError, OSError):
    """The disk (or quota) filled during a write; the partial temporary was removed and nothing was replaced."""

    def __str__(self) -> str:  # the one line alone, without OSError's "[Errno 28]" prefix
        return str(self.strerror)


@dataclass(frozen=True)
class OutputKind:
    """A kind of folder draftsmith writes: ``name`` (in messages), ``recognize(folder)`` (True for a folder of this
    kind) and ``files``: the glob patterns (relative paths, ``/``-separated) of every file the kind ever writes."""

    name: str
    recognize: Callable[[Path], bool]
    files: tuple[str, ...] = field(default=("*",))

    def foreign_files(self, folder: Path) -> list[str]:
        """Relative paths under ``folder`` that no writer of this kind makes (sorted)."""
        found = (p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir())
        return sorted(f for f in found if not any(fnmatch.fnmatch(f, pattern) for pattern in self.files))


def human_bytes(n: float) -> str:
    """``1234567`` -> ``1.23 MB`` (decimal units, as ``df -H`` prints)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def is_disk_full(err: BaseException | None) -> bool:
    """True when ``err`` (or an error it was raised from) is a full disk or an exceeded quota."""
    seen = 0
    while err is not None and seen < 8:  # torch and Lightning wrap the OSError; follow the chain a little way
        if isinstance(err, OSError) and err.errno in FULL_DISK_ERRNOS:
            return True
        if "No space left on device" in str(err) or "Disk quota exceeded" in str(err):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def free_bytes(path: Path) -> int | None:
    """Free bytes on the file system holding ``path`` (its nearest existing parent), None if unknown."""
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def disk_full_message(path: Path, needed: int | None, written: int = 0, kept: str = "nothing was replaced") -> str:
    """One line: the path, what the write needs, what is free, what was ``kept`` and what to do."""
    free = free_bytes(path.parent)
    need = f"about {human_bytes(needed)}" if needed else f"more than the {human_bytes(written)} it had written"
    have = f"{human_bytes(free)} free" if free is not None else "free space unknown"
    return (f"no space left on the device for {path}: it needs {need} ({have}); the partial write was removed and "
            f"{kept}: free space and run the command again")


def _pid_of(name: str, marker: str) -> int | None:
    """The pid in ``.<name><marker><pid>[-...]``, or None."""
    digits = name.rpartition(marker)[2].split("-")[0]
    return int(digits) if digits.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_temporaries(folder: Path, pattern: str = ".*.tmp-*") -> list[Path]:
    """Delete ``pattern`` entries of ``folder`` (``.<name>.tmp-<pid>...``) whose process is gone, warning once per
    entry; returns them. A live pid's temporary is another write in progress and stays."""
    stale = [p for p in sorted(Path(folder).glob(pattern))
             if (pid := _pid_of(p.name, ".tmp-")) is not None and pid != os.getpid() and not _alive(pid)]
    for path in stale:
        log.warning("removing %s, left by an earlier write that did not finish (process %s is gone)", path,
                    _pid_of(path.name, ".tmp-"))
        _remove(path)
    return stale


def _recover_swaps(out: Path) -> None:
    """Undo a swap a dead process left half done: its ``.<name>.old-<pid>`` goes back if ``out`` is missing."""
    for old in sorted(out.parent.glob(f".{out.name}.old-*")):
        pid = _pid_of(old.name, ".old-")
        if pid is None or pid == os.getpid() or _alive(pid):
            continue
        if out.exists() or out.is_symlink():
            log.warning("removing %s, the previous %s a finished swap left behind", old, out.name)
            _remove(old)
        else:
            log.warning("restoring %s from %s: an earlier write stopped between its two renames", out, old.name)
            os.replace(old, out)


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_folder_target(out_dir: str | Path, kind: OutputKind, sources: Iterable[str | Path | None] = ()) -> Path:
    """Refuse (:class:`OutputRefused`, one line) an ``out_dir`` that :func:`write_folder` must not replace; returns
    it resolved. Call it before long work so a bad ``--out`` fails at the start."""
    out = Path(out_dir).expanduser().resolve()
    for source in filter(None, sources):
        src = Path(source).expanduser().resolve()
        if _inside(src, out):
            raise OutputRefused(f"--out {out_dir} is {'the' if src == out else 'a folder holding the'} source "
                                f"{source}: writing there would replace what is being read; choose another --out")
    if out.is_file() or out.is_symlink():
        raise OutputRefused(f"--out {out_dir} is a file, not a folder: nothing was written; choose another --out")
    if not out.is_dir() or not any(out.iterdir()):
        return out
    if not kind.recognize(out):
        shown = ", ".join(sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())[:4])
        raise OutputRefused(f"--out {out_dir} exists and is not a draftsmith {kind.name} (it holds {shown}): "
                            "nothing was written or deleted; choose a new folder, or move its files out first")
    foreign = kind.foreign_files(out)
    if foreign:
        raise OutputRefused(f"--out {out_dir} is a draftsmith {kind.name} but also holds files draftsmith did not "
                            f"write ({', '.join(foreign[:4])}): nothing was replaced; move them out or choose "
                            "another folder")
    return out


def _sync_tree(folder: Path) -> int:
    """fsync every file under ``folder`` (so the rename publishes complete files); returns their total bytes."""
    total = 0
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
            total += path.stat().st_size
    return total


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def write_folder(out_dir: str | Path, fill: Callable[[Path], object], kind: OutputKind,
                 sources: Iterable[str | Path | None] = (), size_hint: int | None = None) -> Path:
    """Create or replace ``out_dir`` atomically: ``fill(tmp)`` writes a sibling temporary folder that is renamed into
    place once complete. Returns ``out_dir`` resolved.

    Refused before any write (:func:`check_folder_target`): a folder that is not a ``kind`` output, one holding files
    the kind never writes, or one of ``sources``. Any failure removes the temporary and leaves the previous
    ``out_dir`` as it was; a full disk raises :class:`DiskFullError` (``size_hint``: the bytes the folder needs).
    """
    sources = tuple(sources)
    out = check_folder_target(out_dir, kind, sources)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out.parent, f".{out.name}.tmp-*")
    _recover_swaps(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        fill(tmp)
        _sync_tree(tmp)
        check_folder_target(out_dir, kind, sources)  # the fill may have taken minutes: look again before replacing
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        _remove(old)
    except BaseException as err:
        written = _tree_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(err):
            raise DiskFullError(errno.ENOSPC, disk_full_message(out, size_hint, written)) from err
        raise
    return out


def check_file_target(path: str | Path, owned: Callable[[Path], bool] | None = None) -> Path:
    """Refuse (:class:`OutputRefused`) a ``path`` that is a folder, an existing file ``owned`` says draftsmith did
    not write, or one under a folder that cannot be written (its nearest existing ancestor is a file or read-only).
    Creates nothing, so a writer calls it before its work. Returns ``path`` resolved."""
    out = Path(path).expanduser().resolve()
    if out.is_dir():
        raise OutputRefused(f"{path} is a folder; a file was expected there: nothing was written")
    if out.exists() and owned is not None and not owned(out):
        raise OutputRefused(f"{path} exists and was not written by draftsmith: nothing was replaced; choose another "
                            "name or move it away")
    ancestor = next(p for p in out.parents if p.exists())
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputRefused(f"cannot write {path}: {ancestor} is {'a file' if not ancestor.is_dir() else 'read-only'}; "
                            "choose another place")
    return out


def _fill_file(tmp: Path, content: str | bytes | Callable[[Path], object]) -> None:
    if callable(content):
        content(tmp)
    else:
        with open(tmp, "wb") as fh:
            fh.write(content.encode("utf-8") if isinstance(content, str) else content)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())


def write_file(path: str | Path, content: str | bytes | Callable[[Path], object],
               owned: Callable[[Path], bool] | None = None) -> Path:
    """Write ``path`` atomically: ``content`` (text, bytes, or a callable that writes the temporary path it is given)
    goes to ``.<name>.tmp-<pid>-<random>`` beside it, is fsynced, then renamed over ``path``. A failure removes the
    temporary and keeps the old file; a full disk raises :class:`DiskFullError` naming ``path``. ``owned``: see
    :func:`check_file_target`. Returns ``path`` resolved."""
    out = check_file_target(path, owned)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out.parent, f".{out.name}.tmp-*")
    handle, name = tempfile.mkstemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent)
    os.close(handle)
    tmp = Path(name)
    try:
        _fill_file(tmp, content)
        os.replace(tmp, out)
    except BaseException as err:
        written = tmp.stat().st_size if tmp.exists() else 0
        tmp.unlink(missing_ok=True)
        if is_disk_full(err):
            needed = len(content) if isinstance(content, (str, bytes)) else None
            raise DiskFullError(errno.ENOSPC, disk_full_message(out, needed, written)) from err
        raise
    return out


@contextlib.contextmanager
def scratch_folder(beside: str | Path) -> Iterator[Path]:
    """A temporary folder ``.<name>.tmp-<pid>-<random>`` next to ``beside`` (same file system, so what is built there
    can be renamed into place), removed on exit; one a killed process leaves is removed by the next write of
    ``beside`` (:func:`remove_stale_temporaries`)."""
    out = Path(beside).expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out.parent, f".{out.name}.tmp-*")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
