"""Disk space: what a full disk (or quota) looks like in an error chain, the free space, and the one
line a writer prints when a write runs out of space (:mod:`draftsmith.common.atomic_folder` and the
checkpoint writer use it).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


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
    # torch and Lightning wrap the OSError; follow the chain a little way
    while err is not None and seen < 8:
        if isinstance(err, OSError) and err.errno in FULL_DISK_ERRNOS:
            return True
        if "No space left on device" in str(err) or "Disk quota exceeded" in str(err):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def free_bytes(path: Path) -> int | None:
    """Free bytes on the file system holding ``path`` (its nearest existing parent), None if
    unknown."""
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def disk_full_message(
    path: Path, needed: int | None, written: int = 0, kept: str = "nothing was replaced"
) -> str:
    """One line: the path, what the write needs, what is free, what was ``kept`` and what to do."""
    free = free_bytes(path.parent)
    need = (
        f"about {human_bytes(needed)}"
        if needed
        else f"more than the {human_bytes(written)} it had written"
    )
    have = f"{human_bytes(free)} free" if free is not None else "free space unknown"
    return (
        f"no space left on the device for {path}: it needs {need} ({have}); the partial write was"
        f" removed and {kept}: free space and run the command again"
    )


__all__ = ["FULL_DISK_ERRNOS", "disk_full_message", "free_bytes", "human_bytes", "is_disk_full"]
