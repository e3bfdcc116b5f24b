"""The DFlash mask token: ``drafter.mask_token_id``, or (null) the first of the tokenizer's pad, unk
and other special tokens that is neither bos nor eos and never occurs in the scanned training data.
An id outside the vocabulary or one that occurs in the training data is refused: the drafter could
not tell a mask slot from text.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from draftsmith.common.errors import ConfigError


def mask_candidates(tokenizer: Any) -> list[int]:
    """Token ids that may serve as the mask token, best first: pad, unk, the other special tokens,
    then the added (reserved) tokens, e.g. SmolLM2's ``<repo_name>``; never bos or eos."""
    never = {getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)}
    added = sorted(getattr(tokenizer, "added_tokens_decoder", None) or {})
    ids = [
        getattr(tokenizer, "pad_token_id", None),
        getattr(tokenizer, "unk_token_id", None),
        *(getattr(tokenizer, "all_special_ids", None) or []),
        *added,
    ]
    return [int(i) for i in dict.fromkeys(ids) if i is not None and i not in never]


def resolve_mask_token(
    requested: int | None,
    tokenizer: Any,
    vocab: int,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
) -> int:
    """The mask token id: ``requested`` checked, or the first candidate the training data never
    contains."""
    if requested is not None and not 0 <= requested < vocab:
        raise ConfigError(
            f"drafter.mask_token_id={requested} is outside the vocabulary 0..{vocab - 1}"
        )
    seen = torch.zeros(vocab, dtype=torch.long)
    for input_ids, _ in batches:
        seen += torch.bincount(input_ids.flatten().clamp(0, vocab - 1).cpu(), minlength=vocab)[
            :vocab
        ]
    if requested is not None:
        if int(seen[requested]):
            name = tokenizer.convert_ids_to_tokens(requested) if tokenizer is not None else "?"
            raise ConfigError(
                f"drafter.mask_token_id={requested} ({name!r}) occurs {int(seen[requested])} times "
                "in the training data: a mask slot would look like text; pick an unused id, or null"
            )
        return requested
    for cand in mask_candidates(tokenizer) if tokenizer is not None else []:
        if 0 <= cand < vocab and not int(seen[cand]):
            return cand
    raise ConfigError(
        "no special token of the tokenizer is absent from the training data to serve as the DFlash "
        "mask token; set drafter.mask_token_id to an id the data never contains"
    )
