"""Training from an offline feature cache (:mod:`draftsmith.distill.feature_cache.build`) without
loading the target.

``data.features=DIR`` swaps in :class:`CachedFeatureDataModule` (the cached batches, in the order
the online data module serves them, resumable mid-epoch, read from a checked :class:`FeatureCache`)
and :class:`~draftsmith.distill.feature_cache.cached_target.CachedTarget` (the target's stand-in;
its features come with each batch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from draftsmith.common.cache_costs import MANIFEST
from draftsmith.distill.data.resumable import (
    ResumableLoader,
    ResumableSampler,
    batches_done_in_epoch,
)
from draftsmith.distill.feature_cache.manifest import (
    FORMAT,
    HEAD_FILE,
    PREFIX,
    TARGET_DIR,
    FeatureCacheError,
    differences,
    settings_of,
)
from draftsmith.distill.feature_cache.shards import content_damage, shard_damage

REBUILD = (
    "rebuild it with `draftsmith cache-features recipe=... --out DIR` (a re-run resumes) or train"
    " online"
)


def read_manifest(path: Path) -> dict:
    """The cache's manifest, refused in one line when it is missing, unreadable or not a feature
    cache's."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise FeatureCacheError(
            f"data.features={path} is not a feature cache (no {MANIFEST}: the cache-features run "
            f"never started there or was stopped early); {REBUILD}"
        ) from None
    except (OSError, ValueError) as err:
        raise FeatureCacheError(
            f"feature cache {path}: its {MANIFEST} is unreadable ({err}); {REBUILD}"
        ) from None
    fields = ("shards", "batches", "settings", "features", "taps", "target")
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not all(k in manifest for k in fields)
    ):
        raise FeatureCacheError(
            f"{path / MANIFEST} is not a draftsmith feature cache manifest (or lacks "
            f"{', '.join(fields)}); {REBUILD}"
        )
    return manifest


class FeatureCache:
    """A complete cache folder: its manifest and lazily opened shards."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        missing = [
            s["file"] for s in self.manifest["shards"] if not (self.path / s["file"]).is_file()
        ]
        if not (self.path / TARGET_DIR / HEAD_FILE).is_file():
            missing.append(f"{TARGET_DIR}/{HEAD_FILE}")
        damaged = (
            []
            if missing
            else [
                f"{s['file']} ({why})"
                for s in self.manifest["shards"]
                if (why := shard_damage(self.path / s["file"])) is not None
            ]
        )
        head = self.path / TARGET_DIR / HEAD_FILE
        if not missing and (why := shard_damage(head)) is not None:
            damaged.append(f"{TARGET_DIR}/{HEAD_FILE} ({why})")
        if damaged:
            raise FeatureCacheError(
                f"feature cache {self.path} has damaged shards: {'; '.join(damaged[:3])}"
                f"{' ...' if len(damaged) > 3 else ''}; {REBUILD} (the re-run rewrites them)"
            )
        if missing or not self.manifest.get("complete"):
            raise FeatureCacheError(
                f"feature cache {self.path} is incomplete ({len(missing)} of "
                f"{len(self.manifest['shards'])} shards missing: {', '.join(missing[:3])}"
                f"{' ...' if len(missing) > 3 else ''}); {REBUILD}"
            )
        self.where: dict[str, str] = {}  # "train.3" -> shard file
        for shard in self.manifest["shards"]:
            for g in range(shard["start"], shard["stop"]):
                self.where[self.key(g)] = shard["file"]
        self._handles: dict[str, Any] = {}

    def key(self, g: int) -> str:
        """``split.i`` of the ``g``-th batch of the cache (train batches first, then val)."""
        n_train = int(self.manifest["batches"]["train"])
        return f"train.{g}" if g < n_train else f"val.{g - n_train}"

    def check(self, cfg: Any) -> None:
        """Refuse a cache built for another recipe, target or data settings, naming what differs."""
        diff = differences(self.manifest["settings"], settings_of(cfg))
        if diff:
            raise FeatureCacheError(
                f"feature cache {self.path} was built for another configuration: "
                f"{'; '.join(diff)}; {REBUILD}"
            )

    def _open(self, file: str) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            damage = content_damage(
                self.path / file
            )  # once per shard and process, before any batch of it is used
            if damage is not None:
                raise FeatureCacheError(
                    f"feature cache {self.path} has a damaged shard: {file} ({damage}); "
                    f"{REBUILD} (the re-run rewrites it)"
                )
            self._handles[file] = safe_open(str(self.path / file), framework="pt")
        return self._handles[file]

    def batch(self, split: str, i: int) -> dict[str, torch.Tensor]:
        """Batch ``i`` of ``split``: ids and masks [B, T] (long) and ``features.<name>`` [B, T,
        H]."""
        name = f"{split}.{i}"
        handle = self._open(self.where[name])
        out = {
            k: handle.get_tensor(f"{name}.{k}").long()
            for k in ("input_ids", "attention_mask", "loss_mask")
        }
        out.update(
            {PREFIX + f: handle.get_tensor(f"{name}.{f}") for f in self.manifest["features"]}
        )
        if self.manifest["taps"].get("lazy_logits"):  # the target's greedy ids [B, T]
            out[PREFIX + "greedy_ids"] = handle.get_tensor(f"{name}.greedy_ids").long()
        return out

    def samples(self, split: str = "train") -> list[dict]:
        """The unpadded samples of ``split`` in their original order (draft-vocabulary scans read
        these)."""
        found: dict[int, dict] = {}
        for i in range(int(self.manifest["batches"][split])):
            name = f"{split}.{i}"
            handle = self._open(self.where[name])
            indices = json.loads(handle.metadata()["indices"])[name]
            ids, attn, loss = (
                handle.get_tensor(f"{name}.{k}")
                for k in ("input_ids", "attention_mask", "loss_mask")
            )
            for row, j in enumerate(indices):
                n = int(attn[row].sum())
                found[j] = {
                    "input_ids": ids[row, :n].long().numpy(),
                    "loss_mask": loss[row, :n].long().numpy(),
                }
        return [found[j] for j in sorted(found)]

    def __getstate__(self) -> dict:  # DataLoader workers reopen the shards
        return {**self.__dict__, "_handles": {}}


class CachedBatches(Dataset):
    """The cached batches of one split; item ``i`` is a whole collated batch."""

    def __init__(self, cache: FeatureCache, split: str) -> None:
        self.cache, self.split = cache, split
        self._samples: list[dict] | None = None

    def __len__(self) -> int:
        return int(self.cache.manifest["batches"][self.split])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.cache.batch(self.split, index)

    @property
    def samples(self) -> list[dict]:
        """The split's samples (for recipes that count tokens, e.g. EAGLE-3's draft vocabulary)."""
        if self._samples is None:
            self._samples = self.cache.samples(self.split)
        return self._samples


class CachedFeatureDataModule(pl.LightningDataModule):
    """Cached batches served like :class:`~draftsmith.distill.data.datamodule.ChatDataModule` serves
    them."""

    def __init__(self, cache: FeatureCache, num_workers: int = 0) -> None:
        super().__init__()
        self.cache, self.num_workers = cache, num_workers
        self.train_set, self.val_set = CachedBatches(cache, "train"), CachedBatches(cache, "val")

    def setup(self, stage: str | None = None) -> None:
        """Nothing to prepare: the batches are on disk."""

    def train_dataloader(self) -> DataLoader:
        """Batch r, r+W, ... to rank r in the cached order, resumable mid-epoch."""
        trainer = self.trainer
        sampler = ResumableSampler.for_trainer(len(self.train_set), trainer)

        def done() -> int:
            return batches_done_in_epoch(
                trainer.global_step, trainer.num_training_batches, trainer.accumulate_grad_batches
            )

        return ResumableLoader(
            self.train_set,
            batch_size=None,
            sampler=sampler,
            num_workers=self.num_workers,
            batches_done=done,
            items_per_batch=1,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_set, batch_size=None, shuffle=False, num_workers=self.num_workers
        )


_OPEN: dict[str, FeatureCache] = {}


def open_cache(cfg: Any) -> FeatureCache:
    """The cache of ``cfg.data.features``, checked against ``cfg`` (one instance per folder and
    process)."""
    path = str(Path(str(cfg.data.features)).expanduser().resolve())
    cache = _OPEN.get(path) or FeatureCache(path)
    cache.check(cfg)
    _OPEN[path] = cache
    return cache


def cached_datamodule(cfg: Any, kind: str) -> CachedFeatureDataModule:
    """The data module for ``data.features`` (chat batches only)."""
    if kind != "chat":
        raise FeatureCacheError(
            f"data.features serves chat batches; this recipe trains on {kind!r} batches"
        )
    return CachedFeatureDataModule(open_cache(cfg), int(cfg.data.num_workers))


def train_offline(
    cfg: Any, recipe: Any, run_dir: str | Path, run_name: str | None = None
) -> dict[str, Any]:
    """:func:`draftsmith.distill.engine.trainer.train` from a feature cache (the trainer opens the
    cache's stand-in target itself when ``data.features`` is set); refuses what cannot work without
    a loaded target first.
    """
    from draftsmith.distill.engine import trainer

    if cfg.target.get("shard"):
        raise FeatureCacheError(
            "target.shard=true with data.features: training from a feature cache loads no "
            "target to shard; drop target.shard"
        )
    return trainer.train(cfg, recipe, run_dir, run_name=run_name)
