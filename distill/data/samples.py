"""Chat conversations -> token ids + assistant-only loss masks (tokenizer chat template), datasets
and batching.

Conventions: a sample is ``{"input_ids": [...], "loss_mask": [...]}`` of equal length;
``loss_mask[t] == 1`` means token ``t`` was written by the assistant (its content and its
end-of-turn token), so it is a valid *label* position. Consumers shift: a head that predicts token
``t + k`` from position ``t`` reads ``loss_mask[t + k]``. Conversations are rendered with the
tokenizer's own chat template.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from draftsmith.common.chat import render_chat
from draftsmith.common.errors import DataError

logger = logging.getLogger(__name__)

_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")

# --------------------------------------------------------------------------- tokenising


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool = False) -> str:
    # The one rendering serving uses too (common.chat); tokenized below without added special
    # tokens, as there.
    return render_chat(tokenizer, messages, generation_prompt)


def _end_of_turn_ids(tokenizer: Any) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    unk = tokenizer.unk_token_id
    for tok in _END_OF_TURN:
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != unk:
            ids.add(tid)
    return ids


class TemplateError(DataError):
    """The tokenizer's chat template cannot be split into per-turn spans (so no loss mask)."""


def _assistant_spans(
    tokenizer: Any, messages: list[dict], full: str, stop_char: int
) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of assistant turns in ``full`` (content + end of turn).

    For assistant message ``i`` the span starts after the generation header that the template
    appends to ``messages[:i]`` and ends where ``messages[:i+1]`` ends. Spans starting at or after
    ``stop_char`` (beyond truncation) are not computed.
    """
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i]) if i else ""
        if len(before) >= stop_char:  # this turn starts after the truncation point
            break
        # some templates reject []
        context = messages[:i] if i else [{"role": "user", "content": "x"}]
        plain = before if i else _render(tokenizer, context)
        header = _render(tokenizer, context, generation_prompt=True)[len(plain) :]
        after = _render(tokenizer, messages[: i + 1])
        if not full.startswith(after) or not after.startswith(before):
            raise TemplateError(
                "the chat template renders earlier turns differently once later turns are added "
                "(e.g. it rewrites past assistant turns); such templates are not supported"
            )
        start = after.find(header, len(before)) if header else -1
        if start < 0:
            raise TemplateError(
                f"the chat template's generation prompt {header!r} does not appear before the "
                "assistant turn; cannot locate assistant tokens (template unsupported)"
            )
        spans.append((start + len(header), len(after)))
    return spans


def tokenize_conversation(
    tokenizer: Any, messages: list[dict], max_length: int
) -> dict[str, list[int]]:
    """Tokenise ``messages`` with the tokenizer's own chat template; mask exactly the assistant
    tokens.

    Returns ``{"input_ids": [...], "loss_mask": [...]}`` truncated to ``max_length``. The mask
    covers each assistant turn's content and its end-of-turn token (not the role header, not the
    newline after the end-of-turn token, not system/user text). Needs a fast tokenizer (offset
    mapping). Raises :class:`TemplateError` when the template cannot be split into turns or the mask
    comes out all ones / all zeros for a conversation with assistant text.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TemplateError(
            "tokenize_conversation needs a fast (Rust) tokenizer for offset mapping"
        )
    full = _render(tokenizer, messages)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"][:max_length])
    offsets = np.asarray(enc["offset_mapping"][: len(ids)], dtype=np.int64).reshape(
        -1, 2
    )  # [T, 2] chars
    stop_char = int(offsets[-1, 1]) if len(ids) else 0
    starts = offsets[:, 0]  # [T] first character of each token, non-decreasing
    mask = np.zeros(len(ids), dtype=np.int64)  # [T]
    end_ids = _end_of_turn_ids(tokenizer)
    spans = _assistant_spans(tokenizer, messages, full, stop_char)
    for lo_char, hi_char in spans:
        lo, hi = np.searchsorted(starts, lo_char, "left"), np.searchsorted(starts, hi_char, "left")
        turn = ids[lo:hi]
        ends = [j for j, t in enumerate(turn) if t in end_ids]
        if ends:  # stop at the end-of-turn token: what follows it (a newline) is template glue
            hi = lo + ends[-1] + 1
        mask[lo:hi] = 1
    if len(ids) and mask.all():
        raise TemplateError("loss mask covers every token; the chat template looks unsupported")
    if spans and any(s < stop_char for s, _ in spans) and not mask.any():
        raise TemplateError(
            "loss mask is empty although the conversation has assistant text; the chat template "
            "looks unsupported"
        )
    return {"input_ids": ids, "loss_mask": mask.tolist()}


# ---------------------------------------------------------------------- datasets, packing, batching


class ChatDataset(Dataset):
    """Tokenised samples (dicts with ``input_ids`` and ``loss_mask``, lists or 1-D numpy arrays)."""

    def __init__(self, samples: Sequence[dict]):
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]

    @property
    def lengths(self) -> list[int]:
        """Token count of each sample."""
        return [len(s["input_ids"]) for s in self.samples]


class PrebuiltBatches(Dataset):
    """Pre-built batches of a :class:`ChatDataset`: item ``i`` is the list of samples of batch
    ``i``.

    Used with ``DataLoader(batch_size=None)`` so that a distributed sampler splits whole batches.
    """

    def __init__(self, dataset: ChatDataset, batches: list[list[int]]):
        self.dataset, self.batches = dataset, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> list[dict]:
        return [self.dataset[i] for i in self.batches[index]]


def bucket_by_length(
    lengths: Sequence[int], batch_size: int, seed: int = 0, window: int = 64
) -> list[list[int]]:
    """Group indices into batches of similar length to limit padding (deterministic for a seed).

    Indices are shuffled, cut into windows of ``batch_size * window``, sorted by length inside each
    window and split into batches; the batch order is shuffled again.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths))
    lengths = np.asarray(lengths)
    span = batch_size * window
    batches = []
    for lo in range(0, len(order), span):
        chunk = order[lo : lo + span]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches += [chunk[i : i + batch_size].tolist() for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def collate(batch: Sequence[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad samples into ``input_ids``, ``attention_mask`` and ``loss_mask``, each ``[B, T]``
    long."""
    width = max(len(s["input_ids"]) for s in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, T]
    attention = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
    for row, sample in enumerate(batch):
        n = len(sample["input_ids"])
        input_ids[row, :n] = torch.as_tensor(np.asarray(sample["input_ids"]), dtype=torch.long)
        attention[row, :n] = 1
        loss_mask[row, :n] = torch.as_tensor(np.asarray(sample["loss_mask"]), dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}


def pad_id_of(tokenizer: Any) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0
