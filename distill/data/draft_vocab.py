"""A reduced draft vocabulary counted on the training split: shared by every recipe whose head
scores only the most frequent assistant tokens (EAGLE-3's drafter, Medusa heads with
``heads.draft_vocab_size``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from draftsmith.common.errors import DataError, DraftsmithError
from draftsmith.drafters.vocab import draft_vocab_from_batches

log = logging.getLogger(__name__)


def training_token_batches(
    cfg: Any, target: Any, max_samples: int | None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, loss_mask) of the training split, built exactly as the trainer's data module
    builds it.

    Iterates the split's samples in a fixed order (not a shuffled loader) so every DDP rank gets the
    same vocabulary; the tokenised data is cached, so the trainer's own data module then reads it
    from disk.
    """
    from draftsmith.distill.data.datamodule import build_datamodule

    data = build_datamodule(cfg, target.tokenizer, packing=False)
    data.setup("fit")
    samples = data.train_set.samples
    for sample in samples[:max_samples] if max_samples else samples:
        yield torch.tensor(sample["input_ids"]), torch.tensor(sample["loss_mask"])


def count_draft_vocab(
    cfg: Any,
    target: Any,
    size: int,
    samples: int | None = None,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None,
    key: str = "drafter.draft_vocab_size",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` of the ``size`` most frequent assistant tokens of the training split (or of
    ``batches``), logging how much of the assistant text they cover. ``key`` names the config key of
    the size in messages.
    """
    batches = batches if batches is not None else training_token_batches(cfg, target, samples)
    try:
        d2t, t2d, stats = draft_vocab_from_batches(batches, target.vocab_size, size, key)
    except ValueError as err:
        if isinstance(err, DraftsmithError):
            raise
        raise DataError(f"{err} ({key}={size})") from err
    log.info(
        "draft vocabulary: %d of %d target tokens cover %.1f%% of %d assistant tokens (%d"
        " distinct)",
        size,
        target.vocab_size,
        100 * stats["coverage"],
        stats["tokens"],
        stats["distinct"],
    )
    return d2t, t2d
