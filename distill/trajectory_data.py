"""The ``trajectories`` batch kind: Learn2PD oracle examples (block confidences -> "already final" labels).

Reads a folder written by ``draftsmith trajectories`` (``meta.json`` + ``shard-*.safetensors``). Batches are
``{"conf": [B, L] float, "labels": [B, L] float}`` plus ``input_ids`` / ``attention_mask`` [B, 1] placeholders so the
trainer's token count reads as examples. An empty, incomplete or corrupt folder is refused before training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from draftsmith.distill.datamodule import register_batch_kind
from draftsmith.distill.errors import ConfigError, DataError

META = "meta.json"


def read_trajectories(folder: str | Path) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """``(meta, conf [N, L], labels [N, L])`` of a trajectory folder, with one clear error for each broken state."""
    from safetensors import safe_open

    folder = Path(folder)
    fix = f"run `draftsmith trajectories --target ... --prompts ... --out {folder}` (it resumes)"
    if not folder.is_dir():
        raise DataError(f"trajectory folder {folder} does not exist; {fix}")
    if not (folder / META).is_file():
        raise DataError(f"{folder} has no {META}: it is empty or not a trajectory folder; {fix}")
    meta = json.loads((folder / META).read_text())
    shards = sorted(folder.glob("shard-*.safetensors"))
    expected = -(-int(meta["num_prompts"]) // int(meta["shard_size"]))
    if not shards:
        raise DataError(f"{folder} holds no trajectory shards (expected {expected}); {fix}")
    if len(shards) < expected:
        raise DataError(f"{folder} is incomplete: {len(shards)} of {expected} shards; {fix} to finish it")
    confs, labels = [], []
    for path in shards:
        try:
            with safe_open(str(path), framework="pt") as handle:
                confs.append(handle.get_tensor("conf").float())  # [n, L]
                labels.append(handle.get_tensor("labels").float())  # [n, L]
        except Exception as err:  # noqa: BLE001 - safetensors raises several types for truncated files
            raise DataError(f"trajectory shard {path} is truncated or corrupt ({type(err).__name__}); delete it and "
                            f"{fix} to rewrite it") from None
    conf, label = torch.cat(confs), torch.cat(labels)
    if conf.shape[1] != int(meta["block_length"]) or conf.shape != label.shape or not len(conf):
        raise DataError(f"{folder}: shards do not match block length {meta['block_length']} (conf {tuple(conf.shape)}, "
                        f"labels {tuple(label.shape)}); regenerate the folder")
    return meta, conf, label


def collate_trajectories(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack examples into a batch (placeholders make ``attention_mask.sum()`` count examples)."""
    conf = torch.stack([r[0] for r in rows])  # [B, L]
    labels = torch.stack([r[1] for r in rows])  # [B, L]
    ones = torch.ones(len(rows), 1, dtype=torch.long)
    return {"conf": conf, "labels": labels, "input_ids": ones, "attention_mask": ones}


class TrajectoryDataModule(pl.LightningDataModule):
    """Seeded train/validation split of a trajectory folder, shuffled batches (full batch when ``batch_size`` is
    at least the number of examples: the paper's setting)."""

    def __init__(self, folder: str | Path, batch_size: int, val_fraction: float = 0.1, seed: int = 0) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        self.folder, self.batch_size, self.val_fraction, self.seed = Path(folder), batch_size, val_fraction, seed
        self.meta: dict[str, Any] = {}
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        self.meta, conf, labels = read_trajectories(self.folder)
        order = torch.randperm(len(conf), generator=torch.Generator().manual_seed(self.seed))
        n_val = min(len(conf) - 1, max(1, round(len(conf) * self.val_fraction))) if self.val_fraction else 0
        self.val_set = TensorDataset(conf[order[:n_val]], labels[order[:n_val]])
        self.train_set = TensorDataset(conf[order[n_val:]], labels[order[n_val:]])

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, collate_fn=collate_trajectories,
                          generator=torch.Generator().manual_seed(self.seed))

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return DataLoader(self.val_set, batch_size=self.batch_size, collate_fn=collate_trajectories)


@register_batch_kind("trajectories")
def build_trajectory_datamodule(cfg: Any, tokenizer: Any, packing: bool | None = None) -> TrajectoryDataModule:
    """``data.spec`` is the trajectory folder (``data=DIR`` on the command line)."""
    return TrajectoryDataModule(str(cfg.data.spec), int(cfg.data.batch_size), float(cfg.data.val_fraction),
                                int(cfg.run.seed))
