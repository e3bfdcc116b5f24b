"""A resumable output folder of datagen (``draftsmith rollouts``, ``draftsmith trajectories``): its
settings file is written first, and a rerun into it with other settings is refused, so the rows
already there and the ones a rerun adds were made alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def start_folder(
    out: Path, meta_file: str, meta: dict[str, Any], what: str, error: type[Exception]
) -> None:
    """Create ``out`` with ``meta`` in ``out / meta_file``; a folder whose settings differ raises
    ``error`` naming the settings that differ (``what``: what the folder holds)."""
    if (out / meta_file).is_file():
        old = json.loads((out / meta_file).read_text())
        if old != meta:
            diff = sorted(k for k in set(meta) | set(old) if old.get(k) != meta.get(k))
            raise error(
                f"{out} holds {what} made with other settings ({', '.join(diff)}); use another"
                " --out folder or remove it"
            )
    out.mkdir(parents=True, exist_ok=True)
    (out / meta_file).write_text(json.dumps(meta, indent=2) + "\n")
