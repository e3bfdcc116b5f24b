"""The conversations ``draftsmith regenerate`` reads: the embedded ShareGPT dump or a local
.jsonl/.json file of ShareGPT (``conversations: [{from, value}]``) or OpenAI (``messages: [{role,
content}]``) records, normalised to role/content dicts."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from draftsmith import assets
from draftsmith.common.chat import encode_chat
from draftsmith.common.errors import DataError, InputError, InputNotFoundError

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}


# Topics a regenerated set can be narrowed to, by its first user message. "code": a request that
# names a language, shows code or asks for a function/script (a drafter trained on chat alone had
# its first guess accepted 0.36 of the time on HumanEval against 0.57 on its own chat: coding
# replies were what it lacked).
TOPICS: dict[str, re.Pattern | None] = {
    "all": None,
    "code": re.compile(
        r"```|\bdef |\bpython\b|\bjavascript\b|\btypescript\b|\bfunction\b|\bcode\b|\bSQL\b|"
        r"\bjava\b|C\+\+|\breact\b|\bscript\b|\bimport |\bclass ",
        re.IGNORECASE,
    ),
}


def normalize_messages(record: Any) -> list[dict[str, str]]:
    """ShareGPT ``conversations: [{from, value}]`` or OpenAI ``messages: [{role, content}]`` ->
    role/content dicts."""
    turns = None
    if isinstance(record, dict):
        turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        raise DataError("expected a 'conversations' (ShareGPT) or 'messages' (OpenAI) list")
    out = []
    for i, turn in enumerate(turns):
        role = (
            ROLES.get(str(turn.get("role", turn.get("from"))).lower())
            if isinstance(turn, dict)
            else None
        )
        content = turn.get("content", turn.get("value")) if isinstance(turn, dict) else None
        if role is None or not isinstance(content, str | None):
            raise DataError(
                f"message {i} needs a known role ({', '.join(sorted(ROLES))}) and string content"
            )
        out.append({"role": role, "content": content or ""})
    return out


def iter_conversations(spec: str, report: Any = None) -> Iterator[tuple[int, list[dict]]]:
    """Yield ``(source_index, messages)`` from ``"sharegpt"`` (embedded) or a local .jsonl/.json
    file.

    ``source_index`` is the 0-based record position in the file. Malformed records fail with
    file:line in a user file and are skipped (counted in ``report``) in the embedded dump.
    """
    embedded = spec.strip().lower() == "sharegpt"
    path = assets.sharegpt_path() if embedded else Path(spec).expanduser()
    if path.is_dir():
        raise InputError(
            f"--data {path} is a folder: pass a .jsonl/.json file of conversations, or sharegpt"
        )
    if not path.is_file():
        raise InputNotFoundError(
            f"data file {path} does not exist; pass --data sharegpt or a .jsonl/.json of "
            "conversations"
        )
    for index, (line, record) in enumerate(assets.iter_json_records(path)):
        try:
            yield index, normalize_messages(record)
        except ValueError as err:
            if not embedded:
                raise DataError(f"{path}:{line}: {err}. Fix the record or remove it.") from None
            if report is not None:
                report.skip("malformed record")


def select_conversations(
    conversations: Iterable[tuple[int, list[dict]]], topic: str = "all", skip: int = 0
) -> Iterator[tuple[int, list[dict]]]:
    """The ``(source_index, messages)`` of ``conversations`` at index ``skip`` or later whose first
    user message is on ``topic`` (a key of :data:`TOPICS`); ``skip`` lets a second set start past
    the records a first one used.
    """
    if topic not in TOPICS:
        raise InputError(f"unknown topic {topic!r}; choose one of {', '.join(TOPICS)}")
    if skip < 0:
        raise InputError(f"skip must be >= 0, got {skip}")
    pattern = TOPICS[topic]
    for index, messages in conversations:
        if index < skip:
            continue
        if pattern is not None:
            user = next((m["content"] for m in messages if m["role"] == "user"), "")
            if not pattern.search(user):
                continue
        yield index, messages


def reply_slots(messages: list[dict]) -> list[int]:
    """Where replies go: assistant turns preceded by a user turn, plus one after a trailing user
    turn."""
    slots = [
        i
        for i, m in enumerate(messages)
        if m["role"] == "assistant" and any(p["role"] == "user" for p in messages[:i])
    ]
    if messages and messages[-1]["role"] == "user":
        slots.append(len(messages))
    return slots


def turns_before(messages: list[dict], cursor: int, slot: int) -> list[dict]:
    """The turns a regenerated reply at ``slot`` sees of ``messages[cursor:slot]``: the original
    replies dropped."""
    return [m for m in messages[cursor:slot] if m["role"] != "assistant"]


def short_prompts(
    conversations: Iterator[tuple[int, list[dict]]],
    tokenizer: Any,
    max_prompt_tokens: int | None,
    report: Any = None,
) -> Iterator[tuple[int, list[dict]]]:
    """The ``(index, messages)`` whose first reply's prompt (chat template and generation prompt
    included) has at most ``max_prompt_tokens`` tokens, all of them when it is None; ``report``
    counts the others as skipped.
    """
    for index, messages in conversations:
        slots = reply_slots(messages)
        if max_prompt_tokens is not None and slots:
            prompt = encode_chat(tokenizer, turns_before(messages, 0, slots[0]))
            if len(prompt) > max_prompt_tokens:
                if report is not None:
                    report.skip("prompt over --max-prompt-tokens")
                continue
        yield index, messages


__all__ = [
    "ROLES",
    "TOPICS",
    "iter_conversations",
    "normalize_messages",
    "reply_slots",
    "select_conversations",
    "short_prompts",
    "turns_before",
]
