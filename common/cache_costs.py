"""What a feature cache cost to build (CPU seconds per shard, in ``build_costs.json`` beside its
shards), read by training's cache writer and by the learning curve that bills a cached run for it;
plain files, no framework.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith.common.atomic_folder import write_file

MANIFEST = (  # the feature cache's manifest (draftsmith.distill.feature_cache.build writes it)
    "manifest.json"
)
# beside the shards, so a resumed cache's shards stay byte-identical to a fresh one's
BUILD_COSTS = "build_costs.json"


def record_build_cost(out: Path, shard_file: str, cpu_seconds: float) -> None:
    """Keep what computing one shard cost (CPU seconds), so a learning curve trained from the cache
    can be billed."""
    path = Path(out) / BUILD_COSTS
    costs = json.loads(path.read_text()) if path.is_file() else {}
    costs[shard_file] = float(cpu_seconds)
    write_file(path, json.dumps(costs, indent=1))


def build_cpu_seconds(out: Path, shards: list[dict]) -> float | None:
    """CPU seconds the cache in ``out`` took to compute. A shard whose cost was not kept (a run
    killed between writing it and its cost) is estimated at the others' CPU seconds per token; None
    when no shard's cost was kept (a cache written before costs were recorded) or a shard is
    missing."""
    out = Path(out)
    path = out / BUILD_COSTS
    costs = json.loads(path.read_text()) if path.is_file() else {}
    if not costs or any(not (out / s["file"]).is_file() for s in shards):
        return None
    known = [s for s in shards if s["file"] in costs]
    per_token = sum(costs[s["file"]] for s in known) / max(
        1, sum(s.get("tokens", 0) for s in known)
    )
    return sum(
        costs[s["file"]] if s["file"] in costs else per_token * s.get("tokens", 0) for s in shards
    )


def training_bill(cache_dir: Path) -> dict[str, Any] | None:
    """``{"path", "cpu_seconds", "train_tokens"}`` of the cache in ``cache_dir`` (the non-padding
    training tokens, as training counts them); None when the folder holds no manifest."""
    path = Path(cache_dir).expanduser().resolve()
    if not (path / MANIFEST).is_file():
        return None
    manifest = json.loads((path / MANIFEST).read_text())
    return {
        "path": str(path),
        "cpu_seconds": build_cpu_seconds(path, manifest["shards"]),
        "train_tokens": (manifest.get("nonpad_tokens") or {}).get("train"),
    }


__all__ = ["BUILD_COSTS", "MANIFEST", "build_cpu_seconds", "record_build_cost", "training_bill"]
