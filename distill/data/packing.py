"""Token-budget batches: conversations bin-packed into fixed-length rows with document ids and
restarting positions.

A GPU step costs about the same host time whatever it carries, so a step should carry many tokens,
in shapes that never change (a compiled or captured step is specialised to its shapes). Here every
training batch is ``R`` rows of exactly ``L`` tokens (``L = data.max_length``; ``R =
data.tokens_per_step // L``, or ``data.batch_size`` with ``data.packing=true``):

* :func:`pack_rows` bin-packs conversations (best fit, longest first, inside seeded windows so the
  data order stays random) into rows of at most ``L`` tokens: a few percent of padding instead of
  greedy packing's 12-17 %.
* :func:`collate_packed` writes each row's ``document_ids`` (0, 1, ... per conversation, -1 =
  padding) and ``position_ids`` (restarting at 0 in every conversation), so the target and the
  drafter attend inside a document only and see the positions the conversation would have alone
  (``distill/target/static_forward.py``).
* :func:`row_batches` groups rows ``R`` at a time; the last batch is filled up with empty rows (all
  padding) so it has the same shape as the others.

Rows are dicts with ``input_ids`` / ``loss_mask`` (the conversations concatenated) and
``document_lengths``, so code that only pads rows (``samples.collate``) still reads them.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import torch

# rows' worth of conversations packed together: enough choice for a tight fit, order kept random
PACK_WINDOW_ROWS = 64


def pack_rows(
    samples: Sequence[dict], row_length: int, seed: int = 0, window_rows: int = PACK_WINDOW_ROWS
) -> list[dict]:
    """Bin-pack ``samples`` (``input_ids``, ``loss_mask``) into rows of at most ``row_length``
    tokens (longer samples are cut), in a seeded order: samples are shuffled, taken ``window_rows *
    row_length`` tokens at a time, and each window is packed best-fit decreasing; the rows are
    shuffled again. Deterministic for a seed."""
    if row_length < 2:
        raise ValueError(f"row_length must be >= 2, got {row_length}")
    rng = np.random.default_rng(seed)
    lengths = np.asarray([min(len(s["input_ids"]), row_length) for s in samples])
    order = rng.permutation(len(samples))
    bins: list[list[int]] = []
    window: list[int] = []
    used = 0
    for index in order:
        window.append(int(index))
        used += int(lengths[index])
        if used >= window_rows * row_length:
            bins += best_fit_decreasing(window, lengths, row_length)
            window, used = [], 0
    bins += best_fit_decreasing(window, lengths, row_length)
    rows = [packed_row([samples[i] for i in members], row_length) for members in bins]
    return [rows[i] for i in rng.permutation(len(rows))]


def best_fit_decreasing(indices: list[int], lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of ``indices`` (each of ``lengths[i] <= capacity``): longest first, each into the
    fullest bin it fits."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin index), sorted
    for index in sorted(indices, key=lambda i: (-int(lengths[i]), i)):
        size = int(lengths[index])
        at = bisect.bisect_left(free, (size, -1))  # the bin with the least room that still fits
        if at == len(free):
            bins.append([index])
            bisect.insort(free, (capacity - size, len(bins) - 1))
            continue
        room, which = free.pop(at)
        bins[which].append(index)
        bisect.insort(free, (room - size, which))
    return bins


def packed_row(samples: Sequence[dict], row_length: int) -> dict:
    """One row: the samples' tokens and loss masks concatenated (each cut at ``row_length``) and
    their lengths."""
    ids = [np.asarray(s["input_ids"][:row_length], dtype=np.int64) for s in samples]
    masks = [np.asarray(s["loss_mask"][:row_length], dtype=np.int64) for s in samples]
    return {
        "input_ids": np.concatenate(ids),
        "loss_mask": np.concatenate(masks),  # [<= row_length]
        "document_lengths": [len(x) for x in ids],
        "num_sequences": len(ids),
    }


def row_batches(row_count: int, rows_per_batch: int) -> list[list[int]]:
    """Row indices of each batch, ``rows_per_batch`` at a time (the last may be short: the collate
    pads it)."""
    if rows_per_batch < 1:
        raise ValueError(f"rows_per_batch must be >= 1, got {rows_per_batch}")
    return [
        list(range(a, min(a + rows_per_batch, row_count)))
        for a in range(0, row_count, rows_per_batch)
    ]


def collate_packed(
    rows: Sequence[dict], row_length: int, pad_id: int, rows_per_batch: int | None = None
) -> dict[str, torch.Tensor]:
    """``[R, L]`` tensors of packed rows: ``input_ids``, ``attention_mask``, ``loss_mask``,
    ``document_ids`` (-1 = padding) and ``position_ids`` (0 at each document's start; padding keeps
    its column index). ``rows_per_batch`` > ``len(rows)`` adds empty rows, so every batch has the
    same shape."""
    count = max(len(rows), rows_per_batch or 0)
    input_ids = np.full((count, row_length), pad_id, dtype=np.int64)  # [R, L]
    loss_mask = np.zeros((count, row_length), dtype=np.int64)
    documents = np.full((count, row_length), -1, dtype=np.int64)
    positions = np.tile(np.arange(row_length, dtype=np.int64), (count, 1))
    for r, row in enumerate(rows):
        lengths = row.get("document_lengths") or [len(row["input_ids"])]
        n = int(sum(lengths))
        if n > row_length:
            raise ValueError(f"a packed row holds {n} tokens, more than its length {row_length}")
        input_ids[r, :n] = row["input_ids"]
        loss_mask[r, :n] = row["loss_mask"]
        documents[r, :n] = np.repeat(np.arange(len(lengths)), lengths)
        starts = np.repeat(np.cumsum([0, *lengths[:-1]]), lengths)  # each token's document start
        positions[r, :n] = np.arange(n) - starts
    batch = {
        "input_ids": input_ids,
        "attention_mask": (documents >= 0).astype(np.int64),
        "loss_mask": loss_mask,
        "document_ids": documents,
        "position_ids": positions,
    }
    return {k: torch.from_numpy(v) for k, v in batch.items()}


def packing_report(rows: Sequence[dict], row_length: int) -> dict[str, float]:
    """Rows, conversations per row and the padding share of packed ``rows``."""
    tokens = sum(len(r["input_ids"]) for r in rows)
    return {
        "rows": len(rows),
        "conversations_per_row": round(
            sum(len(r["document_lengths"]) for r in rows) / max(len(rows), 1), 2
        ),
        "padding": round(1 - tokens / max(len(rows) * row_length, 1), 4),
    }
