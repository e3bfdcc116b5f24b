"""The tokenised-sample cache file (``~/.cache/draftsmith/data/chat-<key>.safetensors``): written
atomically with a checksum of its arrays, verified on every read; its key names the data source by
:func:`spec_identity` (a local file by its content), as the feature cache's fingerprint does.

Samples are stored as three flat arrays (int32 ids, uint8 loss mask, int64 lengths) and a
``draftsmith`` metadata entry (the tokenising report and ``sha256``, the digest of the arrays'
bytes). :func:`load_samples` raises :class:`DamagedCache` for a file cut short, a header that does
not parse, arrays that disagree or a digest that does not match; the data module then says so in one
line and tokenises again (a damaged cache used to give the same traceback on every re-run). The file
is written through :func:`~draftsmith.common.atomic_folder.write_file` (beside, fsynced, renamed): a
full disk or a read-only cache folder leaves no partial file and training goes on without the cache,
with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from functools import lru_cache, partial
from pathlib import Path

import numpy as np

from draftsmith.common.atomic_folder import DiskFullError, OutputRefused, write_file
from draftsmith.common.errors import DataError

logger = logging.getLogger(__name__)

_KEYS = ("input_ids", "loss_mask", "lengths")


class DamagedCache(DataError):
    """A tokenised-sample cache file that cannot be read back whole (the data module rebuilds
    it)."""


def pack_samples_arrays(samples: Sequence[dict]) -> dict[str, np.ndarray]:
    """Samples as the three flat arrays the cache stores."""
    return {
        "input_ids": np.concatenate(
            [np.asarray(s["input_ids"], dtype=np.int32) for s in samples]
        ),  # [sum N_i]
        "loss_mask": np.concatenate(
            [np.asarray(s["loss_mask"], dtype=np.uint8) for s in samples]
        ),  # [sum N_i]
        "lengths": np.asarray([len(s["input_ids"]) for s in samples], dtype=np.int64),  # [N]
    }


def unpack_samples(arrays: dict[str, np.ndarray]) -> list[dict]:
    """Samples as numpy views into the flat arrays (compact; shared, not copied, by forked loader
    workers)."""
    bounds = np.concatenate([[0], np.cumsum(arrays["lengths"])])
    ids, mask = arrays["input_ids"], arrays["loss_mask"]
    return [
        {"input_ids": ids[a:b], "loss_mask": mask[a:b]} for a, b in zip(bounds[:-1], bounds[1:])
    ]


def arrays_digest(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 of the arrays' bytes, in a fixed order."""
    digest = hashlib.sha256()
    for key in _KEYS:
        digest.update(np.ascontiguousarray(arrays[key]).tobytes())
    return digest.hexdigest()


def save_samples(path: Path, samples: Sequence[dict], metadata: dict) -> bool:
    """Write samples (and ``metadata``) to ``path`` atomically, with their digest; True when
    written. A full disk or an unwritable cache folder is a warning (training goes on without the
    cache), never a partial file.
    """
    from safetensors.numpy import save_file

    arrays = pack_samples_arrays(samples)
    header = {"draftsmith": json.dumps({**metadata, "sha256": arrays_digest(arrays)})}
    try:
        write_file(path, lambda tmp: save_file(arrays, str(tmp), metadata=header))
    except (DiskFullError, OutputRefused) as err:
        logger.warning(
            "the tokenised data is not cached (%s); training goes on without the cache", err
        )
        return False
    return True


def _read_arrays(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    from safetensors import SafetensorError, safe_open

    from draftsmith.common.safetensors_check import safetensors_problem

    problem = safetensors_problem(path)
    if problem:
        raise DamagedCache(problem)
    try:
        with safe_open(str(path), framework="numpy") as handle:
            metadata = json.loads((handle.metadata() or {}).get("draftsmith", "{}"))
            arrays = {k: handle.get_tensor(k) for k in _KEYS}
    except (SafetensorError, OSError, KeyError, ValueError) as err:
        raise DamagedCache(f"it does not read back ({' '.join(str(err).split())})") from None
    return arrays, metadata


def load_samples(path: Path) -> tuple[list[dict], dict]:
    """Read samples written by :func:`save_samples` (samples and their metadata), verified: raises
    :class:`DamagedCache` saying what is wrong. Files written before digests were recorded are
    checked for shape.
    """
    arrays, metadata = _read_arrays(Path(path))
    total = int(arrays["lengths"].sum()) if arrays["lengths"].size else 0
    if (
        arrays["input_ids"].shape != (total,)
        or arrays["loss_mask"].shape != (total,)
        or (arrays["lengths"] < 0).any()
    ):
        raise DamagedCache(
            f"its arrays disagree ({arrays['input_ids'].size} ids, {arrays['loss_mask'].size} mask "
            f"entries, lengths summing to {total})"
        )
    want = metadata.pop("sha256", None)
    if want is not None and arrays_digest(arrays) != want:
        raise DamagedCache("its contents do not match the checksum recorded when it was written")
    return unpack_samples(arrays), metadata


def spec_identity(spec: str, with_path: bool = True) -> dict:
    """What identifies the data source: a local file by its content (size and SHA-256), and by its
    absolute path unless ``with_path`` is off (the tokenised cache: the same data copied elsewhere,
    e.g. a test's fresh tmp file, reuses one entry instead of adding another); a named dataset by
    its name."""
    path = Path(spec).expanduser()
    if spec.strip().lower() != "sharegpt" and path.is_file():
        stat = path.stat()
        where = {"path": str(path.resolve())} if with_path else {}
        return {
            **where,
            "size": stat.st_size,
            "sha256": _file_sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns),
        }
    return {"name": spec}


@lru_cache(maxsize=64)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    """SHA-256 of a file, read once per (path, size, mtime): ``cache_path`` is asked for more than
    once a run."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(partial(handle.read, 1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
