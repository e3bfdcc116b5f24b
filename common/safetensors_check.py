"""Whether a file is a complete safetensors file, from its header alone (no tensor is read): the one
check behind the target folder, the tokenised-data cache and the converted embedded target."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def safetensors_problem(file: str | Path) -> str | None:
    """Why ``file`` is not a complete safetensors file (a truncated download or copy, a header that
    does not parse), or None; reads its header only."""
    file = Path(file)
    size = file.stat().st_size
    try:
        with open(file, "rb") as fh:
            if size < 8:
                raise ValueError(f"{size} bytes")
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if header_len > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(fh.read(header_len))
        end = max(
            (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0
        )
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        return f"its header is unreadable ({err})"
    if 8 + header_len + end > size:
        return f"it is truncated: {size:,} bytes, its header needs {8 + header_len + end:,}"
    return None
