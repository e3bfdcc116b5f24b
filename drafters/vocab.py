"""EAGLE-3 draft vocabulary: the most frequent target tokens in the assistant parts of the training
data.

Draft ids are the selected target ids in ascending order, so ``d2t[d] = target_id(d) - d >= 0``
(EAGLE-3's and speculators' offset convention: ``target_id = d + d2t[d]``) and ``t2d`` is a bool
membership mask over the target vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

log = logging.getLogger(__name__)


def count_assistant_tokens(
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int
) -> torch.Tensor:
    """Token counts [V] (int64) over the positions where ``loss_mask`` is 1.

    ``batches`` yields ``(input_ids, loss_mask)`` pairs of equal shape (any batch layout, e.g. [B,
    T]).
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for input_ids, loss_mask in batches:
        if input_ids.shape != loss_mask.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and loss_mask {tuple(loss_mask.shape)} differ"
            )
        ids = input_ids[loss_mask.bool()].to("cpu", torch.long)  # [N]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(
                f"token id out of range 0..{vocab_size - 1} while counting the draft vocabulary: "
                "is the data tokenized with the target's tokenizer?"
            )
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def select_draft_vocab(
    counts: torch.Tensor, draft_vocab_size: int, key: str = "drafter.draft_vocab_size"
) -> torch.Tensor:
    """The ``draft_vocab_size`` most frequent target ids, ascending [N]; ties (and unseen tokens) by
    lower id. ``key`` is the config key that sets the size (named in the warning)."""
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab_size}, got {draft_vocab_size}")
    seen = int((counts > 0).sum())
    if seen < draft_vocab_size:
        log.warning(
            "only %d distinct assistant tokens seen for a draft vocabulary of %d: the rest is"
            " filled with unseen ids (scan more data, or lower %s)",
            seen,
            draft_vocab_size,
            key,
        )
    order = torch.sort(
        -counts, stable=True
    ).indices  # by decreasing count, lower id first among ties
    return order[:draft_vocab_size].sort().values


def vocab_maps(target_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t [N] long, t2d [V] bool)`` for ascending, distinct ``target_ids`` [N]."""
    target_ids = target_ids.to(torch.long)
    if target_ids.numel() > 1 and not bool((target_ids[1:] > target_ids[:-1]).all()):
        raise ValueError(
            "draft vocabulary target ids must be strictly ascending (use select_draft_vocab)"
        )
    d2t = target_ids - torch.arange(target_ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t, t2d


def draft_vocab_from_batches(
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    vocab_size: int,
    draft_vocab_size: int,
    key: str = "drafter.draft_vocab_size",
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Count assistant tokens in ``batches`` and build ``(d2t, t2d, stats)``.

    ``stats`` has ``tokens`` (assistant tokens scanned), ``distinct`` and ``coverage`` (share of the
    scanned assistant tokens that the draft vocabulary contains).
    """
    counts = count_assistant_tokens(batches, vocab_size)
    total = int(counts.sum())
    if total == 0:
        raise ValueError(
            "no assistant tokens (loss_mask == 1) in the batches scanned for the draft vocabulary; "
            "check the data's loss masks"
        )
    ids = select_draft_vocab(counts, draft_vocab_size, key)
    d2t, t2d = vocab_maps(ids, vocab_size)
    stats = {
        "tokens": float(total),
        "distinct": float((counts > 0).sum()),
        "coverage": float(counts[ids].sum()) / total,
    }
    return d2t, t2d, stats
