"""What a feature cache holds and how its manifest says so: the folder's names and format version,
the features stored for a recipe's taps and their bytes per token, the settings the cache's
fingerprint covers (recipe, target, data), and the plan of its shards. :mod:`.build` writes a
cache with these; :mod:`.cached_data` reads one back and checks it against the run's config.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from draftsmith.common.cache_costs import MANIFEST
from draftsmith.common.errors import ConfigError
from draftsmith.distill.target.features import FeatureTaps

FORMAT, VERSION = "draftsmith-features", 1
TARGET_DIR, HEAD_FILE = "target", "head.safetensors"
# batch keys that carry cached target features (stripped before the objective sees the batch)
PREFIX = "features."
SPLITS = ("train", "val")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class FeatureCacheError(ConfigError):
    """A feature cache cannot be written or used as asked (wrong config, incomplete folder, disk too
    small)."""


def cached_taps(taps: FeatureTaps) -> FeatureTaps:
    """What the cache stores for ``taps``: the hidden states asked for, plus ``final_hidden``
    (logits and top-k are rebuilt from it with the stored LM head); ``lazy_logits`` here means the
    target's greedy ids are stored too (an objective that reads logits lazily then never needs the
    whole [B, T, V] logits rebuilt)."""
    return FeatureTaps(
        final_hidden=True,
        prenorm_hidden=taps.prenorm_hidden,
        layers=tuple(sorted(set(taps.layers))),
        lazy_logits=bool(taps.logits and taps.lazy_logits),
    )


def taps_key(taps: FeatureTaps) -> dict[str, Any]:
    """The taps as the fingerprint and manifest record them (``lazy_logits`` only when set: caches
    written before it existed keep their fingerprint)."""
    return {k: v for k, v in asdict(taps).items() if k != "lazy_logits" or v}


def feature_names(taps: FeatureTaps) -> list[str]:
    """Names of the stored [B, T, H] features of ``taps`` (a :func:`cached_taps` result)."""
    return (
        ["final_hidden"] * taps.final_hidden
        + ["prenorm_hidden"] * taps.prenorm_hidden
        + [f"layer.{i}" for i in taps.layers]
    )


def bytes_per_token(
    n_features: int, hidden: int, dtype: torch.dtype, greedy_ids: bool = False
) -> int:
    """Bytes of one stored position: the features plus the int32 id, the two uint8 masks and, when
    stored, the int32 greedy id of the target."""
    return (
        n_features * hidden * torch.empty((), dtype=dtype).element_size()
        + 4
        + 1
        + 1
        + 4 * greedy_ids
    )


def settings_of(cfg: Any) -> dict[str, Any]:
    """The config that decides what a cache holds (checked again when training from it): recipe,
    target, data."""
    from draftsmith.distill.data.sample_cache import spec_identity

    d, name = cfg.data, str(cfg.target.name_or_path)
    # a local folder: the same whether named relatively or absolutely
    if Path(name).expanduser().exists():
        name = str(Path(name).expanduser().resolve())
    return {
        "recipe": str(cfg.recipe.name),
        "target": {"name_or_path": name},
        "data": {
            "spec": spec_identity(str(d.spec)),
            "limit": d.limit,
            "max_length": int(d.max_length),
            "batch_size": int(d.batch_size),
            "packing": bool(d.packing),
            "val_fraction": float(d.val_fraction),
            "seed": int(cfg.run.seed),
        },
    }


def differences(cached: Any, now: Any, where: str = "") -> list[str]:
    """``key: cache X, now Y`` for every leaf that differs between two nested dicts."""
    if isinstance(cached, dict) and isinstance(now, dict):
        return [
            line
            for key in sorted(set(cached) | set(now), key=str)
            for line in differences(
                cached.get(key), now.get(key), f"{where}.{key}" if where else str(key)
            )
        ]
    return [] if cached == now else [f"{where}: cache {cached!r}, now {now!r}"]


def human(n: float) -> str:
    """``1.5 GB``-style byte count."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def plan_shards(batches: list[tuple[str, int, int]], bpt: int, shard_bytes: int) -> list[dict]:
    """Consecutive batches ``(split, index, positions)`` grouped into shards of about
    ``shard_bytes`` each."""
    shards: list[dict] = []
    for g, (_, _, positions) in enumerate(batches):
        if not shards or shards[-1]["bytes"] + positions * bpt > shard_bytes:
            shards.append(
                {
                    "file": f"shard-{len(shards):05d}.safetensors",
                    "start": g,
                    "stop": g,
                    "tokens": 0,
                    "bytes": 0,
                }
            )
        shard = shards[-1]
        shard["stop"], shard["tokens"], shard["bytes"] = (
            g + 1,
            shard["tokens"] + positions,
            shard["bytes"] + positions * bpt,
        )
    return shards


def resumable_format(out: Path, taps: FeatureTaps) -> FeatureTaps:
    """``taps``, without the stored greedy ids when ``out`` holds a cache begun before they existed
    (it resumes in its own format; training from it rebuilds the whole logits, as it did)."""
    manifest = out / MANIFEST
    if (
        taps.lazy_logits
        and manifest.is_file()
        and "lazy_logits" not in json.loads(manifest.read_text())["taps"]
    ):
        return replace(taps, lazy_logits=False)
    return taps


def new_manifest(
    out: Path,
    cfg: Any,
    taps: FeatureTaps,
    dtype: str,
    shard_bytes: int,
    names: list[str],
    target: Any,
    bpt: int,
    plans: dict[str, Any],
    shards: list[dict],
) -> dict:
    """The (not yet complete) manifest of this cache; refuses when ``out`` holds a cache of another
    configuration."""

    settings = settings_of(cfg)
    key = {
        "settings": settings,
        "taps": taps_key(taps),
        "dtype": dtype,
        "shard_bytes": int(shard_bytes),
    }
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": (
            "sha256:" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        ),
        **key,
        "features": names,
        "hidden_size": target.hidden_size,
        "bytes_per_token": bpt,
        "target": target.identity(),
        "target_dtype": str(target.lm_head_weight.dtype).replace("torch.", ""),
        "batches": {s: len(plans[s][1]) for s in SPLITS},
        "shards": shards,
        # the non-padding tokens of each split, as training counts them (train/tokens)
        "nonpad_tokens": {
            s: sum(len(items[j]["input_ids"]) for b in plan for j in b)
            for s, (items, plan) in plans.items()
        },
        "tokens": sum(s["tokens"] for s in shards),
        "complete": False,
    }
    if (out / MANIFEST).is_file():
        old = json.loads((out / MANIFEST).read_text())
        if old.get("fingerprint") != manifest["fingerprint"]:
            diff = differences({k: old.get(k) for k in key}, key)
            raise FeatureCacheError(
                f"{out} holds a feature cache for another configuration ({'; '.join(diff)}); "
                "choose another --out or delete that folder"
            )
    return manifest


def old_complete(out: Path) -> bool:
    """Whether ``out``'s manifest says the cache is complete."""
    try:
        return bool(json.loads((out / MANIFEST).read_text()).get("complete"))
    except (OSError, ValueError):
        return False


def cacheable_taps(cfg: Any, recipe: Any, target: Any) -> FeatureTaps:
    """The taps to cache for ``recipe``'s objective on ``target``; refuses an objective that
    computes its own target features or trains on other than chat batches."""
    from draftsmith.distill.engine.objective import batch_kind, has_own_features

    objective = recipe.build(cfg, target)
    if has_own_features(objective) or batch_kind(objective) != "chat":
        raise FeatureCacheError(
            f"recipe {cfg.recipe.name} computes its own target features or trains on "
            f"{batch_kind(objective)!r} batches: it cannot train from a feature cache"
        )
    return cached_taps(objective.taps)
