"""Refuse prompts that cannot fit in the target's context before any model work is spent on them."""

from __future__ import annotations

from typing import Any

from draftsmith.common.errors import InputError


def context_limit(model: Any) -> int | None:
    """The target's context in positions (``max_position_embeddings`` of a lean or HF config), None if unknown."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(limit) if limit is not None else None


def check_prompt_fits(ids_len: int, limit: int, what: str) -> None:
    """Raise ``ValueError`` unless a prompt of ``ids_len`` tokens leaves room for one new token in ``limit`` positions.

    ``what`` names the prompt for the user (e.g. ``"conversation 12"``); the message gives its token count and the
    limit. A prompt of exactly ``limit`` tokens is refused too: its first generated token would need position
    ``limit``, which the target was never trained on.
    """
    if ids_len >= limit:
        raise InputError(f"{what} has {ids_len} tokens but the target's context is {limit} positions "
                         f"(max_position_embeddings); it must be at most {limit - 1} tokens to generate anything")


__all__ = ["check_prompt_fits", "context_limit"]
