"""The crash-safe jsonl of ``draftsmith regenerate``: ``OUT.partial`` lines appended and fsync'd one
at a time, the run's settings beside it, resuming after the last complete line, and the progress
line with pace and ETA.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.common.atomic_folder import DiskFullError, disk_full_message, is_disk_full
from draftsmith.common.durations import eta_seconds, format_duration
from draftsmith.common.errors import InputError

DEFAULTS = {"batch_size": 1}  # settings added after a partial was written: the value its writer had


def read_partial(partial: Path) -> tuple[int, int]:
    """Keep the complete lines of an interrupted run: returns ``(lines, last source_index)``; cuts a
    torn tail."""
    data = partial.read_bytes()
    good, lines, last = 0, 0, -1
    for raw in data.splitlines(keepends=True):
        try:
            if not raw.endswith(b"\n"):
                raise ValueError
            last = int(json.loads(raw)["source_index"])
        except (ValueError, KeyError, TypeError):
            if good + len(raw) < len(
                data
            ):  # a bad line in the middle is corruption, not an interruption
                raise InputError(
                    f"{partial} has a corrupt line after {lines} good ones; delete it to start over"
                ) from None
            break
        good, lines = good + len(raw), lines + 1
    if good < len(data):
        with open(partial, "r+b") as handle:
            handle.truncate(good)
    return lines, last


def resume_or_start(
    out: Path, partial: Path, meta_path: Path, settings: dict[str, Any], log: Callable[[str], None]
) -> tuple[int, int]:
    """Continue an interrupted ``partial`` written with the same ``settings``, or start a new one
    (its settings written to ``meta_path``); returns ``(complete lines kept, last source index
    done)``, ``(0, -1)`` when starting. Other settings (a different ``batch_size`` included: batches
    decide the rounding) are refused.
    """
    if not partial.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with disk_full_named(meta_path):
            meta_path.write_text(json.dumps(settings))
        return 0, -1
    try:
        saved = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    except (ValueError, UnicodeDecodeError):
        saved = None
    if not isinstance(saved, dict):
        raise InputError(
            f"{partial} has no readable settings file ({meta_path.name}): it was not written by"
            f" this command, or its settings were deleted; delete {partial} to start over"
        )
    saved = {**{k: v for k, v in DEFAULTS.items() if k in settings}, **saved}
    if saved != settings:
        differ = [k for k in settings if saved.get(k) != settings[k]]
        raise InputError(
            f"{partial} was written with other settings ({saved}; differing: {', '.join(differ)}); "
            f"rerun with those or delete {partial} and {meta_path} to start over"
        )
    lines, last = read_partial(partial)
    log(f"resuming {partial}: {lines} conversations already done (up to source index {last})")
    return lines, last


def append_line(handle: Any, record: dict[str, Any]) -> None:
    """Append one JSON line and force it to disk (a crash keeps every complete line; a full disk is
    one line, and the same command resumes after the last complete one)."""
    with disk_full_named(Path(handle.name)):
        handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


@contextmanager
def disk_full_named(path: Path) -> Iterator[None]:
    """Turn a full disk while writing ``path`` into :class:`DiskFullError`: one line naming it, what
    is free and that the complete lines stay (a torn last line is cut when the same command
    resumes)."""
    try:
        yield
    except OSError as err:
        if not is_disk_full(err):
            raise
        kept = "every complete line is kept, and the same command resumes after the last one"
        raise DiskFullError(errno.ENOSPC, disk_full_message(path, None, kept=kept)) from err


@dataclass
class Progress:
    """The progress line: conversations seen of ``total``, written, tokens, pace and (this run's
    pace only) the ETA.

    ``resumed_before`` is how many source conversations the resumed file already covered, so the ETA
    counts only the conversations this run decodes. ``written`` and ``tokens`` are read from the
    caller's report at each line.
    """

    total: int
    log: Callable[[str], None]
    resumed_before: int = 0
    start: float = field(default_factory=time.perf_counter)
    last_log: float = -1.0

    def tick(self, seen: int, written: int, tokens: int) -> None:
        """Log a line for the ``seen``-th source conversation if 5 s passed since the last one (or
        it is the first)."""
        now = time.perf_counter() - self.start
        if self.last_log >= 0 and now - self.last_log < 5.0:
            return
        self.last_log = now
        left = eta_seconds(seen - self.resumed_before, self.total - self.resumed_before, now)
        self.log(
            f"[{seen}/{self.total}] wrote {written}, {tokens} tokens, {tokens / max(now, 1e-9):.1f}"
            " tokens/s" + (f", eta {format_duration(left)}" if left is not None else "")
        )


__all__ = ["Progress", "append_line", "disk_full_named", "read_partial", "resume_or_start"]
