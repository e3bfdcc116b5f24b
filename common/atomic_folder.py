"""One write discipline for every folder and file draftsmith writes: beside, then swapped in; never
over the user's.

Folders (exports, converted engine layouts, bench output folders): :func:`write_folder` fills a
sibling temporary folder ``.<name>.tmp-<pid>-<random>`` and renames it into place. Before anything
is written it refuses, in one line (:class:`OutputRefused`), to replace

* a path that is a file, or a folder that is not a draftsmith output of the same :class:`OutputKind`
  (the user's ``keep.txt`` and ``sub/keep.txt`` stay where they are);
* an output of that kind that also holds files the kind never writes (the user's notes inside an old
  export);
* one of its own ``sources`` (a converted layout written over the export it was converted from).

Files (``bench.json``, ``bench.md``, reports): :func:`write_file` writes
``.<name>.tmp-<pid>-<random>`` beside the file, fsyncs and renames it over the old one. A writer
(bench/, reports) calls it as::

    from draftsmith.common.atomic_folder import write_file
    write_file(out / "bench.json", json.dumps(result, indent=2) + "\\n")          # text or bytes
    # or a callable writing tmp:
    write_file(out / "plot.png", lambda tmp: fig.savefig(tmp, format="png"))

and calls :func:`check_folder_target` (or :func:`check_output_file`) at its start, so an output that
cannot be written fails before the work, not after it: the rule of what may be written where (never
over or around an input, never over the user's files, never under a read-only or file path) is
:mod:`draftsmith.common.write_rule`, whose names this module re-exports. Declaring a folder kind is
one :class:`OutputKind` (its name, how to recognise one, the file patterns it writes), e.g.
``OutputKind("bench output", lambda f: (f / "bench.json").is_file(), ("bench.json", "bench.md",
"*.png"))``.

A full disk (ENOSPC, or EDQUOT on a quota) during either write removes the temporary and raises
:class:`DiskFullError`, one line naming the path, the space needed and the space free. Temporaries
left by an earlier process that died (its pid is gone) are removed at the next write of the same
name, with a warning; a folder caught between the two renames of a swap (``.<name>.old-<pid>``) is
put back.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

# re-exported: writers import them from here
from draftsmith.common.disk_space import (  # noqa: F401
    FULL_DISK_ERRNOS,
    disk_full_message,
    free_bytes,
    human_bytes,
    is_disk_full,
)
from draftsmith.common.errors import DraftsmithError

# re-exported: writers import them from here
from draftsmith.common.write_rule import (  # noqa: F401
    OutputKind,
    OutputRefused,
    check_file_target,
    check_folder_target,
    check_output_file,
    check_writable,
    refuse_overlap,
    run_folder_problem,
)

log = logging.getLogger(__name__)


class DiskFullError(DraftsmithError, OSError):
    """The disk (or quota) filled during a write; the partial temporary was removed and nothing was
    replaced."""

    def __str__(self) -> str:  # the one line alone, without OSError's "[Errno 28]" prefix
        return str(self.strerror)


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
    """Delete ``pattern`` entries of ``folder`` (``.<name>.tmp-<pid>...``) whose process is gone,
    warning once per entry; returns them. A live pid's temporary is another write in progress and
    stays."""
    stale = [
        p
        for p in sorted(Path(folder).glob(pattern))
        if (pid := _pid_of(p.name, ".tmp-")) is not None and pid != os.getpid() and not _alive(pid)
    ]
    for path in stale:
        log.warning(
            "removing %s, left by an earlier write that did not finish (process %s is gone)",
            path,
            _pid_of(path.name, ".tmp-"),
        )
        _remove(path)
    return stale


def _recover_swaps(out: Path) -> None:
    """Undo a swap a dead process left half done: its ``.<name>.old-<pid>`` goes back if ``out`` is
    missing."""
    for old in sorted(out.parent.glob(f".{out.name}.old-*")):
        pid = _pid_of(old.name, ".old-")
        if pid is None or pid == os.getpid() or _alive(pid):
            continue
        if out.exists() or out.is_symlink():
            log.warning("removing %s, the previous %s a finished swap left behind", old, out.name)
            _remove(old)
        else:
            log.warning(
                "restoring %s from %s: an earlier write stopped between its two renames",
                out,
                old.name,
            )
            os.replace(old, out)


def _sync_tree(folder: Path) -> int:
    """fsync every file under ``folder`` (so the rename publishes complete files); returns their
    total bytes."""
    total = 0
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
            total += path.stat().st_size
    return total


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def write_folder(
    out_dir: str | Path,
    fill: Callable[[Path], object],
    kind: OutputKind,
    sources: Iterable[str | Path | None] = (),
    size_hint: int | None = None,
) -> Path:
    """Create or replace ``out_dir`` atomically: ``fill(tmp)`` writes a sibling temporary folder
    that is renamed into place once complete. Returns ``out_dir`` resolved.

    Refused before any write (:func:`check_folder_target`): a folder that is not a ``kind`` output,
    one holding files the kind never writes, or one of ``sources``. Any failure removes the
    temporary and leaves the previous ``out_dir`` as it was; a full disk raises
    :class:`DiskFullError` (``size_hint``: the bytes the folder needs).
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
        check_folder_target(
            out_dir, kind, sources
        )  # the fill may have taken minutes: look again before replacing
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


def _fill_file(tmp: Path, content: str | bytes | Callable[[Path], object]) -> None:
    if callable(content):
        content(tmp)
    else:
        with open(tmp, "wb") as fh:
            fh.write(content.encode("utf-8") if isinstance(content, str) else content)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())


def write_file(
    path: str | Path,
    content: str | bytes | Callable[[Path], object],
    owned: Callable[[Path], bool] | None = None,
) -> Path:
    """Write ``path`` atomically: ``content`` (text, bytes, or a callable that writes the temporary
    path it is given) goes to ``.<name>.tmp-<pid>-<random>`` beside it, is fsynced, then renamed
    over ``path``. A failure removes the temporary and keeps the old file; a full disk raises
    :class:`DiskFullError` naming ``path``. ``owned``: see :func:`check_file_target`. Returns
    ``path`` resolved."""
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
    """A temporary folder ``.<name>.tmp-<pid>-<random>`` next to ``beside`` (same file system, so
    what is built there can be renamed into place), removed on exit; one a killed process leaves is
    removed by the next write of ``beside`` (:func:`remove_stale_temporaries`)."""
    out = Path(beside).expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out.parent, f".{out.name}.tmp-*")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
