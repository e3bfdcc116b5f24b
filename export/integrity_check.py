"""Refuse an export whose method, architecture keys and weight names and shapes no longer make the
unit recorded when it was written (``identity.digest``, :func:`draftsmith.export.identity.
export_digest`), e.g. ``method`` edited to another method with the same weights layout. The weights
are checked from the safetensors headers alone, before any tensor is read.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from draftsmith.export.format import MAIN_PART, ExportError, part_file
from draftsmith.export.identity import export_digest


class ExportIdentityError(ExportError):
    """An export's method, architecture and weight names/shapes no longer make the unit recorded at
    export."""


def _header_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors file's header alone (8-byte length + JSON; no tensor
    is read)."""
    if not path.is_file():
        raise ExportError(f"{path} is missing; re-export the drafter")
    try:
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > 1 << 28:  # no header of ours comes near 256 MB: the length field is garbage
                raise ValueError(f"header length {length}")
            header = json.loads(fh.read(length))
        return {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, struct.error) as err:
        raise ExportError(f"{path} is corrupt or truncated ({err}); re-export the drafter") from err


def verify_identity(export_dir: str | Path, config: dict[str, Any]) -> None:
    """Refuse (:class:`ExportIdentityError`, one line) an export whose method, architecture keys and
    weight names and shapes no longer hash to the ``identity.digest`` recorded when it was written
    (:func:`export_digest`): e.g. ``method`` edited to another method with the same weights layout.
    Exports written before the field existed are not checked."""
    recorded = config.get("identity") or {}
    if not recorded.get("digest"):
        return
    shapes = {
        n: _header_shapes(Path(export_dir) / part_file(n))
        for n in config.get("parts") or {MAIN_PART: {}}
    }
    if export_digest(config["method"], dict(config["architecture"]), shapes) == recorded["digest"]:
        return
    written_as = recorded.get("method")
    if written_as and written_as != config["method"]:
        raise ExportIdentityError(
            f"{export_dir} was written as a {written_as!r} export, but its config.json now says"
            " method "
            f"{config['method']!r} (method, architecture and weights are checked as one): restore "
            f'"method": "{written_as}" in config.json, or re-export the drafter'
        )
    raise ExportIdentityError(
        f"{export_dir}: its architecture keys or weight names and shapes changed after export (they"
        " no longer match the identity recorded at export): restore the original config.json and"
        " weights, or re-export the drafter"
    )
