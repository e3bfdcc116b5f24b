"""The ``trajectories`` batch kind: Learn2PD oracle examples (block confidences -> "already final"
labels).

Reads a folder written by ``draftsmith trajectories`` (``meta.json`` + ``shard-*.safetensors``).
Batches are ``{"conf": [B, L] float, "labels": [B, L] float}`` plus ``input_ids`` /
``attention_mask`` [B, 1] placeholders so the trainer's token count reads as examples. An empty,
incomplete or corrupt folder is refused before training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from draftsmith.common.errors import ConfigError, DataError
from draftsmith.datagen import trajectory_folder
from draftsmith.datagen.trajectory_folder import TrajectoryFolderError
from draftsmith.distill.data.datamodule import register_batch_kind


def read_trajectories(folder: str | Path) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """``(meta, conf [N, L], labels [N, L])`` of a trajectory folder
    (:func:`draftsmith.datagen.trajectory_folder.read_trajectories`); its format errors become
    training's DataError.
    """
    try:
        return trajectory_folder.read_trajectories(folder)
    except TrajectoryFolderError as err:
        raise DataError(str(err)) from None


def collate_trajectories(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack examples into a batch (placeholders make ``attention_mask.sum()`` count examples)."""
    conf = torch.stack([r[0] for r in rows])  # [B, L]
    labels = torch.stack([r[1] for r in rows])  # [B, L]
    ones = torch.ones(len(rows), 1, dtype=torch.long)
    return {"conf": conf, "labels": labels, "input_ids": ones, "attention_mask": ones}


class TrajectoryDataModule(pl.LightningDataModule):
    """Seeded train/validation split of a trajectory folder, shuffled batches (full batch when
    ``batch_size`` is at least the number of examples: the paper's setting)."""

    def __init__(
        self, folder: str | Path, batch_size: int, val_fraction: float = 0.1, seed: int = 0
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        self.folder, self.batch_size, self.val_fraction, self.seed = (
            Path(folder),
            batch_size,
            val_fraction,
            seed,
        )
        self.meta: dict[str, Any] = {}
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        self.meta, conf, labels = read_trajectories(self.folder)
        order = torch.randperm(len(conf), generator=torch.Generator().manual_seed(self.seed))
        n_val = (
            min(len(conf) - 1, max(1, round(len(conf) * self.val_fraction)))
            if self.val_fraction
            else 0
        )
        self.val_set = TensorDataset(conf[order[:n_val]], labels[order[:n_val]])
        self.train_set = TensorDataset(conf[order[n_val:]], labels[order[n_val:]])

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            collate_fn=collate_trajectories,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return DataLoader(self.val_set, batch_size=self.batch_size, collate_fn=collate_trajectories)


@register_batch_kind("trajectories")
def build_trajectory_datamodule(
    cfg: Any, tokenizer: Any, packing: bool | None = None
) -> TrajectoryDataModule:
    """``data.spec`` is the trajectory folder (``data=DIR`` on the command line)."""
    return TrajectoryDataModule(
        str(cfg.data.spec),
        int(cfg.data.batch_size),
        float(cfg.data.val_fraction),
        int(cfg.run.seed),
    )
