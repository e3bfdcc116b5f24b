"""The target's context bounds a request: a prompt that leaves no position is refused, and
``max_new_tokens`` past the context is capped to it with one line, before any model work (or memory:
the KV cache is sized from the request, so 10^9 new tokens would otherwise end in an allocator
error)."""

from __future__ import annotations

import warnings

from draftsmith.common.errors import InputError
from draftsmith.runtime.target.interface import TargetDecoder


class ContextCapWarning(UserWarning):
    """``max_new_tokens`` asked for more tokens than the target's context holds; generation stops at
    its end."""


def context_limit(model: TargetDecoder) -> int | None:
    """The target's context in positions (``max_position_embeddings``), None if its config states
    none."""
    return model.sizes.context_length


def check_prompt_fits(ids_len: int, limit: int, what: str) -> None:
    """Raise ``ValueError`` unless a prompt of ``ids_len`` tokens leaves room for one new token in
    ``limit`` positions.

    ``what`` names the prompt for the user (e.g. ``"conversation 12"``); the message gives its token
    count and the limit. A prompt of exactly ``limit`` tokens is refused too: its first generated
    token would need position ``limit``, which the target was never trained on.
    """
    if ids_len >= limit:
        raise InputError(
            f"{what} has {ids_len} tokens but the target's context is {limit} positions "
            f"(max_position_embeddings); it must be at most {limit - 1} tokens to generate anything"
        )


def cap_new_tokens(prompt_len: int, max_new_tokens: int, limit: int | None) -> int:
    """``max_new_tokens`` capped so that prompt + generated tokens fit ``limit`` positions (the
    target's context; None: no cap). A cap warns once (:class:`ContextCapWarning`, one line naming
    the context); a prompt that leaves no position is refused first (:func:`check_prompt_fits`)."""
    if limit is None:
        return max_new_tokens
    check_prompt_fits(prompt_len, limit, "the prompt")
    room = limit - prompt_len
    if max_new_tokens > room:
        warnings.warn(
            f"max_new_tokens={max_new_tokens} runs past the target's context of {limit} positions "
            "(max_position_embeddings): generation stops at the context's end",
            ContextCapWarning,
            stacklevel=3,
        )
        return room
    return max_new_tokens


__all__ = ["ContextCapWarning", "cap_new_tokens", "check_prompt_fits", "context_limit"]
