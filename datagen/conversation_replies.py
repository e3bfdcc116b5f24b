"""One conversation's replies written by the target: the prompt of each assistant turn, the stop
tokens, and the reply generation :func:`draftsmith.datagen.regenerate.regenerate` runs per
conversation (``--turns first`` or ``all``, greedy or sampled).

A first prompt that does not fit in the target's context gets no reply: it is logged (its token
count and the limit) and skipped before any model work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from draftsmith.common.chat import encode_chat
from draftsmith.datagen.chat_source import reply_slots, turns_before
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.prompt_limits import check_prompt_fits

TURNS = ("first", "all")


def render_prompt(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` in the target's chat template followed by the assistant generation
    prompt (the encoding training and bench use: :func:`draftsmith.common.chat.encode_chat`)."""
    return encode_chat(tokenizer, messages)


def stop_ids(tokenizer: Any, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    """EOS ids of the target plus the tokenizer's EOS and common end-of-turn tokens present in its
    vocabulary."""
    vocab = tokenizer.get_vocab()
    ends = [
        t
        for t in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
        if t in vocab
    ]
    extra = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return tuple(dict.fromkeys([*eos_ids, *extra, *(vocab[t] for t in ends)]))


def _turn_prompt(
    tokenizer: Any,
    history: list[dict],
    messages: list[dict],
    cursor: int,
    slot: int,
    max_new_tokens: int,
    context: int | None,
) -> tuple[list[dict], list[int], int]:
    """The context of the reply at ``slot`` (``history`` plus the non-assistant turns since
    ``cursor``: the original replies are dropped), its prompt ids and its token budget (<= 0 when
    the context is full)."""
    context_msgs = history + turns_before(messages, cursor, slot)
    prompt = render_prompt(tokenizer, context_msgs)
    room = max_new_tokens if context is None else min(max_new_tokens, context - len(prompt))
    return context_msgs, prompt, room


def _too_long(
    prompt: list[int], context: int | None, what: str, log: Callable[[str], None] | None
) -> str:
    """Log why a first prompt gets no reply (its token count and the limit); returns the skip
    reason."""
    try:
        check_prompt_fits(len(prompt), context, what)
    except ValueError as err:
        if log is not None:
            log(f"{err}; skipped")
    return "prompt longer than the context"


def first_turn_prompt(
    tokenizer: Any,
    messages: list[dict],
    max_new_tokens: int,
    context: int | None,
    what: str = "the conversation",
    log: Callable[[str], None] | None = None,
) -> tuple[list[dict], list[int], int] | str:
    """``(context messages, prompt ids, token budget)`` of the first reply, or why there is none
    (the reason :func:`regenerate_conversation` gives); the batched path plans every row with it."""
    slots = reply_slots(messages)
    if not slots:
        return "no user turn"
    context_msgs, prompt, room = _turn_prompt(
        tokenizer, [], messages, 0, slots[0], max_new_tokens, context
    )
    return (context_msgs, prompt, room) if room > 0 else _too_long(prompt, context, what, log)


def regenerate_conversation(
    model: Any,
    tokenizer: Any,
    messages: list[dict],
    turns: str = "first",
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_ids: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
    context: int | None = None,
    what: str = "the conversation",
    log: Callable[[str], None] | None = None,
) -> tuple[list[dict] | None, int, str | None]:
    """Replace the assistant turns of one conversation by the target's replies.

    Returns ``(messages, tokens_generated, note)``. ``messages`` is None when nothing could be
    generated (``note`` says why: no user turn, prompt longer than the context, empty reply). In
    ``"first"`` mode the conversation ends after the first reply; in ``"all"`` mode every assistant
    turn is regenerated with the earlier regenerated replies in context, a trailing user turn gets a
    reply too, and ``note == "truncated"`` when the context filled up. A first prompt that does not
    fit in ``context`` is skipped before any model work; ``log`` then gets one line naming ``what``,
    its token count and the limit.
    """
    if turns not in TURNS:
        raise ValueError(f"turns must be one of {TURNS}, got {turns!r}")
    slots = reply_slots(messages)
    slots = slots[:1] if turns == "first" else slots
    if not slots:
        return None, 0, "no user turn"
    out: list[dict] = []
    total, done, cursor = 0, 0, 0
    for slot in slots:
        context_msgs, prompt, room = _turn_prompt(
            tokenizer, out, messages, cursor, slot, max_new_tokens, context
        )
        if room <= 0:
            if done == 0:
                return None, total, _too_long(prompt, context, what, log)
            return out, total, "truncated"
        tokens = generate_ar(
            model,
            prompt,
            room,
            temperature=temperature,
            top_p=top_p,
            eos_ids=eos_ids,
            generator=generator,
        )
        total += len(tokens)
        out = context_msgs + [reply_message(tokenizer, tokens)]
        cursor, done = slot + 1, done + 1
    if not any(m["role"] == "assistant" and m["content"] for m in out):
        return None, total, "empty reply"
    return out, total, None


def reply_message(tokenizer: Any, tokens: list[int]) -> dict[str, str]:
    """The assistant message of a generated reply (``tokens`` decoded, special tokens dropped)."""
    return {
        "role": "assistant",
        "content": tokenizer.decode(tokens, skip_special_tokens=True).strip(),
    }
