"""Feature-cache shards on disk: written whole (temp name, then rename) and checked whole before
anything reads them (a shard cut short by a full disk or a stopped copy is named, never read as
zeros). Each shard records a digest of its tensors (``digest`` beside the batch indices in its
metadata): a shard whose bytes changed on disk (same size) is found when it is first opened for
training, and by ``cache-features`` (which writes it again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("draftsmith.distill.feature_cache.build")
DIGEST = (  # beside the batch names ("train.3": [row indices]) in the shard's "indices" metadata
    "digest"
)


def shard_damage(path: Path) -> str | None:
    """Why the shard at ``path`` cannot be read whole (None: intact). A safetensors file is an
    8-byte header length, the JSON header, then the tensors at the offsets the header names: a file
    shorter (or longer) than the largest offset was cut, e.g. by a full disk or a copy that stopped,
    and must not be read (its tail would be garbage).
    """
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
    end = max(
        (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0
    )
    if 8 + length + end != size:
        return f"{size:,} bytes where its header needs {8 + length + end:,}"
    return None


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """BLAKE2b of the tensors' names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def content_damage(path: Path) -> str | None:
    """Why the shard's tensors differ from the digest recorded when it was written (reads the whole
    shard), or None; shards written before digests were recorded pass."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            want = json.loads((handle.metadata() or {}).get("indices", "{}")).get(DIGEST)
            if want is None:
                return None
            got = tensors_digest({k: handle.get_tensor(k) for k in handle.keys()})
    except (SafetensorError, OSError) as err:
        return f"unreadable ({err})"
    return (
        None if got == want else "its tensors do not match the digest recorded when it was written"
    )


def intact_shards(out: Path, shards: list[dict], warn: Any = None) -> list[dict]:
    """The planned ``shards`` already written whole in ``out``; a damaged one is removed (and named)
    so that it is written again."""
    done = []
    for shard in shards:
        path = out / shard["file"]
        if not path.is_file():
            continue
        damage = shard_damage(path) or content_damage(path)
        if damage is None:
            done.append(shard)
            continue
        (warn or log.warning)(
            f"feature cache shard {path} is damaged ({damage}): removing it, it is written again"
        )
        path.unlink()
    return done


def write_shard(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """One shard, written to a temp name and renamed: a killed run leaves no half-written shard."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    # one metadata entry: safetensors writes several in a random order, and shards must be
    # byte-identical
    save_file(
        tensors,
        str(tmp),
        metadata={"indices": json.dumps({**meta, DIGEST: tensors_digest(tensors)})},
    )
    os.replace(tmp, path)
