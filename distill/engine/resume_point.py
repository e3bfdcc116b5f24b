"""Which checkpoint a resumed run starts from.

:func:`find_resume_checkpoint` names the newest complete checkpoint of a run folder: what
``last.ckpt`` (a relative symlink, or the ``checkpoints/last`` pointer file where the file system
refuses symlinks) names, a newer SLURM requeue checkpoint, or the highest step file.
:func:`resume_checkpoint` starts from it when its archive reads whole, else from the newest intact
one (a truncated copy, a flipped byte, a ``last.ckpt`` naming a step file that was deleted are each
skipped with one warning naming the file and what is resumed instead, or saying that training
restarts from step 0). How the checkpoints are written and kept: :mod:`.checkpoints`.
"""

from __future__ import annotations

import logging
import os
import zipfile
from pathlib import Path

from draftsmith.distill.engine.checkpoints import (
    CHECKPOINT_DIR,
    LAST_CHECKPOINT,
    LAST_POINTER,
    step_of,
)

log = logging.getLogger(__name__)


def find_resume_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run folder: what ``last.ckpt`` (or the ``last`` pointer)
    names, or a newer SLURM requeue checkpoint (``hpc_ckpt_<n>.ckpt``, written by Lightning on the
    requeue signal), or, when the link itself is missing, the highest ``step<N>.ckpt``."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    candidates: list[Path] = []
    last, named = folder / LAST_CHECKPOINT, pointed(folder)
    if last.exists():
        candidates.append(last.resolve())
    elif named is not None and named.exists():
        candidates.append(named.resolve())
    else:
        steps = sorted(folder.glob("step*.ckpt"), key=step_of)
        candidates.extend(steps[-1:])
    candidates.extend(Path(run_dir).glob("hpc_ckpt_*.ckpt"))
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


def checkpoint_problem(path: str | Path) -> str | None:
    """Why the checkpoint file ``path`` cannot be resumed from (missing, empty, truncated, a damaged
    entry), or None when its archive reads whole (every entry against its CRC). Folders (DeepSpeed,
    sharded FSDP) are not checked.
    """
    path = Path(path)
    if path.is_dir():
        return None
    if not path.exists():
        return "it is missing (deleted?)"
    size = path.stat().st_size
    if size == 0:
        return "it is empty (0 bytes)"
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        return f"it is truncated or damaged ({size:,} bytes; {err})"
    return f"it is damaged (its entry {bad} fails its checksum)" if bad is not None else None


def _named_by_last(folder: Path) -> Path | None:
    """What ``last.ckpt`` (a link, or a copy) or the ``last`` pointer names, whether or not that
    file exists."""
    last = folder / LAST_CHECKPOINT
    if last.is_symlink():
        return folder / os.readlink(last)
    if last.exists():
        return last
    return pointed(folder)


def pointed(folder: Path) -> Path | None:
    """The checkpoint the ``last`` pointer file names (None: no pointer, or one that is not a file
    name)."""
    try:
        name = (folder / LAST_POINTER).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return folder / name if name and "\0" not in name and "/" not in name else None


def resume_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint a resumed run starts from: :func:`find_resume_checkpoint`'s when it reads
    whole, else the newest intact step or requeue checkpoint, with one warning naming the damaged or
    missing file and the fallback (or saying that training restarts from step 0 when no intact
    checkpoint is left)."""
    run_dir = Path(run_dir)
    folder = run_dir / CHECKPOINT_DIR
    first = find_resume_checkpoint(run_dir)
    named = _named_by_last(folder)
    skipped = [named] if named is not None and not named.exists() else []
    if first is not None and checkpoint_problem(first) is None:
        if skipped:
            log.warning(
                "%s names %s, which is missing; resuming from %s instead",
                folder / LAST_CHECKPOINT,
                named.name,
                first,
            )
        return first
    skipped += [first] if first is not None else []
    steps = sorted(
        (p for p in folder.glob("step*.ckpt") if p not in skipped), key=step_of, reverse=True
    )
    requeues = sorted(
        run_dir.glob("hpc_ckpt_*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True
    )
    intact = [
        next((p for p in group if p not in skipped and checkpoint_problem(p) is None), None)
        for group in (steps, requeues)
    ]
    found = max((p for p in intact if p is not None), key=lambda p: p.stat().st_mtime, default=None)
    if not skipped:
        return found
    why = "; ".join(
        f"{p} cannot be resumed: {checkpoint_problem(p)}" for p in dict.fromkeys(skipped)
    )
    if found is None:
        log.warning(
            "%s; no intact checkpoint is left in %s: training restarts from step 0", why, folder
        )
    else:
        log.warning("%s; resuming from %s, the newest intact checkpoint", why, found)
    return found
