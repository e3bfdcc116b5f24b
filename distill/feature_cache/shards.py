"""Feature-cache shards on disk: written whole (temp name, then rename) and checked whole before anything reads
them (a shard cut short by a full disk or a stopped copy is named, never read as zeros)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("draftsmith.distill.feature_cache.build")


def shard_damage(path: Path) -> str | None:
    """Why the shard at ``path`` cannot be read whole (None: intact). A safetensors file is an 8-byte header length,
    the JSON header, then the tensors at the offsets the header names: a file shorter (or longer) than the largest
    offset was cut, e.g. by a full disk or a copy that stopped, and must not be read (its tail would be garbage)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return f"{size} bytes, shorter than a safetensors header"
            length = int.from_bytes(raw, "little")
            if length > size - 8:
                return f"{size} bytes, its header alone claims {length}"
            header = json.loads(f.read(length))
    except (OSError, ValueError) as err:
        return f"unreadable ({err})"
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end != size:
        return f"{size:,} bytes where its header needs {8 + length + end:,}"
    return None


def intact_shards(out: Path, shards: list[dict], warn: Any = None) -> list[dict]:
    """The planned ``shards`` already written whole in ``out``; a damaged one is removed (and named) so that it is
    written again."""
    done = []
    for shard in shards:
        path = out / shard["file"]
        if not path.is_file():
            continue
        damage = shard_damage(path)
        if damage is None:
            done.append(shard)
            continue
        (warn or log.warning)(f"feature cache shard {path} is damaged ({damage}): removing it, it is written again")
        path.unlink()
    return done


def write_shard(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """One shard, written to a temp name and renamed: a killed run leaves no half-written shard."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"indices": json.dumps(meta)})
    os.replace(tmp, path)

