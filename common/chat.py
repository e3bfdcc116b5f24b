"""One chat encoding for training, bench, generate and regenerate, so they never disagree on BOS or
template.

The conversation is rendered to text by the tokenizer's own chat template and the text is tokenized
WITHOUT adding special tokens: templates that want a BOS write it themselves, and adding one again
would double it.
"""

from __future__ import annotations

from typing import Any

from draftsmith.common.errors import InputError


def render_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The template's text for ``messages`` ([{role, content}]), with the assistant header appended
    if asked."""
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(
            "the target's tokenizer has no chat template; chat prompts need a chat (instruct)"
            " target"
        )
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def encode_chat(
    tokenizer: Any, messages: str | list[dict], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of a chat: a plain string is one user turn. By default the assistant generation
    prompt follows, which is what a prompt for generation needs."""
    if isinstance(messages, str):
        if not messages.strip():
            raise InputError("empty prompt: give some text to continue")
        messages = [{"role": "user", "content": messages}]
    text = render_chat(tokenizer, messages, add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
