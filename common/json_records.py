"""Streaming JSON reader: the records of a JSON array (a truncated one too: its complete records,
the cut tail reported) or of a JSON-lines file, one at a time, with the line each starts on. Used
for the embedded ShareGPT dump (125 MB, cut mid-record) and for users' data files;
:mod:`draftsmith.assets` re-exports it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.common.errors import DataError

__all__ = ["ReadReport", "StreamStats", "iter_json_records"]


@dataclass
class ReadReport:
    """What a reader kept and dropped: ``kept`` records, ``skipped`` records, ``turns`` in kept
    records."""

    kept: int
    skipped: int
    turns: int
    reason: str


@dataclass
class StreamStats:
    """Filled in by :func:`iter_json_records` as it goes; final once the iterator is exhausted."""

    records: int = 0
    truncated: bool = False  # the JSON array ends without its closing bracket
    tail_line: int | None = None  # line where the cut record starts (None if nothing was cut off)
    tail_chars: int = 0  # characters of the cut record that were dropped


_WS = re.compile(r"\s*")
_CHUNK = 1 << 22  # 4 Mi characters per read
_MAX_RECORD = (
    1 << 28
)  # a single record larger than this is treated as corrupt, not as "needs more data"


def _needs_more(err: json.JSONDecodeError, size: int) -> bool:
    """True if the decode error could be cured by more input, i.e. the record ran off the buffer's
    end."""
    return err.msg.startswith("Unterminated string") or err.pos >= size - 6


def iter_json_records(
    path: str | Path, stats: StreamStats | None = None
) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, record)`` from a JSON array or a JSON-lines file, streaming.

    A file whose first non-blank character is ``[`` is read as one JSON array with
    ``json.JSONDecoder.raw_decode`` over a buffered read, so a truncated array yields all its
    complete records; the cut last record is dropped and described in ``stats``. Anything else is
    read as JSON lines. A syntax error that is not a truncated tail raises ``ValueError`` naming
    file and line.
    """
    stats = stats if stats is not None else StreamStats()
    path = Path(path)
    with open(path, encoding="utf-8-sig") as handle:  # a UTF-8 BOM (Windows editors) is no error
        head = handle.read(4096)
        first = head.lstrip()[:1]
        handle.seek(0)
        if first == "[":
            yield from _iter_array(handle, path, stats)
            return
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path}:{lineno}: invalid JSON ({err.msg} at column {err.colno}). Expected a"
                    " JSON array or one JSON object per line (JSON lines); fix or remove that"
                    " line."
                ) from None
            stats.records += 1
            yield lineno, record


def _iter_array(handle: Any, path: Path, stats: StreamStats) -> Iterator[tuple[int, Any]]:
    """Stream the elements of a top-level JSON array from an open text file."""
    decoder = json.JSONDecoder()
    buf = handle.read(_CHUNK)
    eof = not buf
    pos = _WS.match(buf).end() + 1  # past the opening '['
    line = 1 + buf.count("\n", 0, pos)
    expect_value = True  # after '[' or ',' a value must follow
    while True:
        skip = _WS.match(buf, pos).end()
        line += buf.count("\n", pos, skip)
        pos = skip
        if pos >= len(buf) - 1 and not eof:  # keep at least one character of look-ahead
            more = handle.read(_CHUNK)
            eof = not more
            buf, pos = buf[pos:] + more, 0
            continue
        if pos >= len(buf):  # end of file without ']'
            stats.truncated = True
            return
        char = buf[pos]
        if char == "]" and (not expect_value or stats.records == 0):
            return
        if char == "," and not expect_value:
            pos += 1
            expect_value = True
            continue
        try:
            record, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as err:
            if not _needs_more(err, len(buf)) or len(buf) - pos > _MAX_RECORD:
                bad_line = line + buf.count("\n", pos, err.pos)
                raise DataError(
                    f"{path}:{bad_line}: invalid JSON in array element {stats.records + 1}"
                    f" ({err.msg}). Fix the file or convert it to JSON lines."
                ) from None
            if eof:  # the file ends inside this record: a truncated tail, dropped and reported
                stats.truncated, stats.tail_line, stats.tail_chars = True, line, len(buf) - pos
                return
            more = handle.read(_CHUNK)
            eof = not more
            buf, pos = buf[pos:] + more, 0
            continue
        if not expect_value:
            raise DataError(f"{path}:{line}: expected ',' or ']' between array elements.")
        stats.records += 1
        yield line, record
        line += buf.count("\n", pos, end)
        pos, expect_value = end, False
