"""Prompt sets for benches and evaluations, chat-encoded and checked against the target's context:
the specs :mod:`draftsmith.common.prompt_sets` reads (``mtbench``, ``humaneval``, ``sharegpt``, a
file, each with an optional ``[a:b]`` slice)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftsmith.common.prompt_sets import encode_texts, prompt_texts
from draftsmith.runtime.decoding.prompt_limits import check_prompt_fits

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_prompts(
    spec: str, tokenizer: PreTrainedTokenizerBase, limit: int | None, max_len: int | None = None
) -> list[list[int]]:
    """The first ``limit`` (all when None) prompts of ``spec`` as chat token ids
    (:mod:`draftsmith.common.prompt_sets`: the one grammar, ``mtbench[40:]`` being
    the prompts a bench on the first ones never sees, for choosing checkpoints on). With
    ``max_len`` (the target's context), a prompt that cannot fit fails at once, named, before any
    model work."""
    texts = prompt_texts(spec, limit)
    encoded = encode_texts(spec, texts, tokenizer)
    for n, ids in enumerate(encoded, 1):
        if max_len is not None:
            check_prompt_fits(len(ids), max_len, f"prompt {n} of {spec} ({texts[n - 1][:40]!r}...)")
    return encoded
