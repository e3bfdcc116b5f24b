"""The ``preference`` batch kind: chosen/rejected pairs of a rollout folder (``draftsmith
rollouts``) for LPO.

A batch of P pairs holds 2P rows, the P chosen responses first and then their P rejected ones (row i
and row P + i are a pair). Each row is ``prompt_ids + response tokens`` (right-padded, cut at
``data.max_length``), with ``choice_index`` [2P, T]: at position t the grid index of the temperature
that sampled token t + 1 (-1 at prompt positions, padding, and the last position), ``first`` [2P]:
the prompt's last position (where the head makes a sequence-level choice), and ``kind`` [2P]: the
prompt kind's number in ``meta["kinds"]`` (for per-kind metrics).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from draftsmith.common.errors import ConfigError, DataError
from draftsmith.datagen import rollout_folder
from draftsmith.datagen.rollout_folder import RolloutFolderError
from draftsmith.distill.data.datamodule import register_batch_kind

log = logging.getLogger(__name__)


def read_pairs(folder: str | Path) -> tuple[dict[str, Any], list[dict]]:
    """``(meta, pairs)`` of a rollout folder (:func:`draftsmith.datagen.rollout_folder.read_pairs`);
    its format errors become training's DataError (one line, the fix included)."""
    try:
        return rollout_folder.read_pairs(folder)
    except RolloutFolderError as err:
        raise DataError(str(err)) from None


ROUND_SEPARATOR = "+"


def read_pair_rounds(spec: str | Path) -> tuple[dict[str, Any], list[dict]]:
    """``(meta, pairs)`` of one rollout folder or of several rounds joined with ``+``
    (``data=r1+r2``): the pairs of every folder, in order. The folders must share the target and the
    temperature grid (their recorded indices point into it); the joined meta is token-level when any
    folder is, and its ``kinds`` are the union."""
    # A folder whose own name holds '+' is one folder, not rounds.
    folders = (
        [str(spec)] if Path(spec).is_dir() else [f for f in str(spec).split(ROUND_SEPARATOR) if f]
    )
    if not folders:
        raise DataError(
            "data.spec is empty; give a rollout folder, or several joined with '+' (data=r1+r2)"
        )
    seen = [Path(f).resolve() for f in folders]
    if len(set(seen)) != len(seen):
        raise DataError(
            f"data.spec {spec} names a rollout folder twice; its pairs would count double (and land"
            " in both the train and the validation split); name each round once"
        )
    meta, pairs = read_pairs(folders[0])
    for folder in folders[1:]:
        other, more = read_pairs(folder)
        for key in ("target", "grid"):
            if other.get(key) != meta.get(key):
                raise DataError(
                    f"{folder} was sampled with {key} {other.get(key)!r} but {folders[0]} with "
                    f"{meta.get(key)!r}; rounds joined with '+' must share the target and the grid"
                )
        if other.get("granularity") == "token":
            meta["granularity"] = "token"
        pairs.extend(more)
    meta["kinds"] = sorted({p["kind"] for p in pairs})
    meta["folders"] = folders
    return meta, pairs


def fitting_pairs(
    pairs: list[dict], max_length: int, folder: Any, meta: dict[str, Any] | None = None
) -> list[dict]:
    """The pairs whose prompt leaves at least one response token within ``max_length``; the others
    are skipped and reported in one warning (how many, the longest prompt, the ``data.max_length``
    that keeps them all). DataError when none is left, before any training step."""
    keep = [p for p in pairs if len(p["prompt_ids"]) < max_length]
    skipped = len(pairs) - len(keep)
    if not skipped:
        return pairs
    longest = max(len(p["prompt_ids"]) for p in pairs)
    need = longest + int((meta or {}).get("max_new_tokens") or 1)
    what = (
        f"{skipped} of {len(pairs)} rollout pair(s) of {folder} have a prompt of"
        f" data.max_length={max_length} tokens or more (the longest {longest}), which leaves no"
        " response token"
    )
    if not keep:
        raise DataError(
            f"{what}: nothing left to train on; set data.max_length={need} (prompt + the rollouts' "
            "max_new_tokens) or make rollouts of shorter prompts"
        )
    log.warning("%s: skipped them; data.max_length=%d keeps them all", what, need)
    return keep


def _row(prompt: list[int], sample: dict, max_length: int) -> tuple[list[int], list[int]]:
    """(ids, choice indices) of prompt + response, cut at ``max_length`` (indices shifted: position
    t chose t + 1)."""
    ids = (list(prompt) + list(sample["tokens"]))[:max_length]
    choice = ([-1] * (len(prompt) - 1) + list(sample["temps"]))[: len(ids) - 1] + [-1]
    return ids, choice


def collate_pairs(
    pairs: list[dict], max_length: int, pad_id: int, kinds: list[str]
) -> dict[str, torch.Tensor]:
    """2P right-padded rows (chosen first, then rejected) with ``choice_index``, ``first`` and
    ``kind``."""
    longest = max(len(p["prompt_ids"]) for p in pairs)
    if longest >= max_length:
        raise DataError(
            f"a prompt of {longest} tokens leaves no response token within"
            f" data.max_length={max_length}; raise data.max_length"
        )
    rows = [
        _row(p["prompt_ids"], p[side], max_length) for side in ("chosen", "rejected") for p in pairs
    ]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [2P, T]
    choice = torch.full((len(rows), width), -1, dtype=torch.long)  # [2P, T]
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # [2P, T]
    for i, (r_ids, r_choice) in enumerate(rows):
        ids[i, : len(r_ids)] = torch.tensor(r_ids)
        choice[i, : len(r_choice)] = torch.tensor(r_choice)
        mask[i, : len(r_ids)] = 1
    first = torch.tensor([len(p["prompt_ids"]) - 1 for p in pairs] * 2)  # [2P]
    kind = torch.tensor([kinds.index(p["kind"]) for p in pairs] * 2)  # [2P]
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "choice_index": choice,
        "first": first,
        "kind": kind,
    }


class PreferenceDataModule(pl.LightningDataModule):
    """Seeded train/validation split of a rollout folder's pairs, shuffled batches of ``batch_size``
    pairs."""

    def __init__(
        self,
        folder: str | Path,
        batch_size: int,
        max_length: int,
        pad_id: int,
        val_fraction: float = 0.1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        self.folder, self.batch_size, self.max_length, self.pad_id = (
            str(folder),
            batch_size,
            max_length,
            pad_id,
        )
        self.val_fraction, self.seed = val_fraction, seed
        self.meta: dict[str, Any] = {}
        self.train_set: list[dict] | None = None
        self.val_set: list[dict] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        self.meta, pairs = read_pair_rounds(self.folder)
        pairs = fitting_pairs(pairs, self.max_length, self.folder, self.meta)
        order = torch.randperm(
            len(pairs), generator=torch.Generator().manual_seed(self.seed)
        ).tolist()
        n_val = (
            min(len(pairs) - 1, max(1, round(len(pairs) * self.val_fraction)))
            if self.val_fraction
            else 0
        )
        self.val_set = [pairs[i] for i in order[:n_val]]
        self.train_set = [pairs[i] for i in order[n_val:]]

    def _collate(self, pairs: list[dict]) -> dict[str, torch.Tensor]:
        return collate_pairs(pairs, self.max_length, self.pad_id, self.meta["kinds"])

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            collate_fn=self._collate,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return DataLoader(self.val_set, batch_size=self.batch_size, collate_fn=self._collate)


@register_batch_kind("preference")
def build_preference_datamodule(
    cfg: Any, tokenizer: Any, packing: bool | None = None
) -> PreferenceDataModule:
    """``data.spec`` is the rollout folder (``data=DIR`` on the command line), or rounds joined with
    ``+``."""
    pad = (
        tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else (tokenizer.eos_token_id or 0)
    )
    return PreferenceDataModule(
        str(cfg.data.spec),
        int(cfg.data.batch_size),
        int(cfg.data.max_length),
        int(pad),
        float(cfg.data.val_fraction),
        int(cfg.run.seed),
    )
