"""Chat conversations from the embedded ShareGPT file, local jsonl/json/parquet files or HF
datasets (opened by :mod:`.sources`), normalised to ``[{"role": "system"|"user"|"assistant",
"content": str}, ...]``; what a load kept and skipped is its :class:`ReadReport`."""

from __future__ import annotations

import logging
from typing import Any

from draftsmith.assets import ReadReport, StreamStats
from draftsmith.common.errors import DataError
from draftsmith.distill.data.sources import as_data_errors, open_records

logger = logging.getLogger(__name__)

_ROLES = {
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


def _as_text(content: Any) -> str:
    """Message content as a string (``None`` -> "", OpenAI content parts -> their joined text)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return "".join(str(p.get("text", "")) for p in content if p.get("type", "text") == "text")
    raise ValueError(f"message content must be a string, got {type(content).__name__}")


def normalize_record(record: Any) -> list[dict]:
    """One record -> ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.

    Accepts ShareGPT (``conversations: [{from, value}]``), OpenAI (``messages: [{role, content}]``),
    a bare list of such messages, and a ``prompt``/``response`` (or ``completion``) pair with
    optional ``system``. Raises ``ValueError`` for anything else.
    """
    if (
        isinstance(record, dict)
        and "prompt" in record
        and ("response" in record or "completion" in record)
    ):
        answer = record["response"] if "response" in record else record["completion"]
        system = (
            [{"role": "system", "content": _as_text(record["system"])}]
            if record.get("system")
            else []
        )
        return system + [
            {"role": "user", "content": _as_text(record["prompt"])},
            {"role": "assistant", "content": _as_text(answer)},
        ]
    turns = record
    if isinstance(record, dict):
        key = (
            "conversations"
            if "conversations" in record
            else "messages"
            if "messages" in record
            else None
        )
        if key is None:
            raise ValueError(
                f"unknown record structure (keys {sorted(record)[:8]}); expected 'conversations' "
                "(ShareGPT), 'messages' (OpenAI) or 'prompt'/'response'"
            )
        turns = record[key]
    if not isinstance(turns, list):
        raise ValueError(f"expected a list of messages, got {type(turns).__name__}")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ValueError(
                f"message {i} is a {type(turn).__name__}, expected an object with role/content"
            )
        role = turn.get("role", turn.get("from"))
        mapped = _ROLES.get(str(role).lower())
        if mapped is None:
            raise ValueError(
                f"message {i} has unknown role {role!r}; expected one of {sorted(_ROLES)}"
            )
        out.append({"role": mapped, "content": _as_text(turn.get("content", turn.get("value")))})
    return out


def _nothing_to_train_on(
    source: Any, records: int, malformed: int, no_assistant: int, cut_line: int | None
) -> str:
    """Why a user's data source gave no conversation: empty, or every record dropped (and for which
    reason)."""
    if records == 0 and cut_line is not None:
        return (
            f"data {source} holds no complete record: the JSON array is cut off in its first record"
            f" (line {cut_line})"
        )
    if records == 0:
        return (
            f"data {source} is empty: it holds no records. Point data= at a .jsonl/.json/.parquet"
            " file of chat conversations (ShareGPT 'conversations' or OpenAI 'messages')."
        )
    return (
        f"data {source}: none of its {records} record(s) has a non-empty assistant turn "
        f"({no_assistant} without an assistant reply, {malformed} malformed); nothing to train on"
    )


def _read_report(
    kept: int, turns: int, malformed: int, no_assistant: int, stats: StreamStats
) -> ReadReport:
    """The :class:`ReadReport` of a load: what was kept, what was skipped and why."""
    reasons = []
    if stats.tail_line is not None:
        reasons.append(
            f"dropped the truncated last record (line {stats.tail_line}, {stats.tail_chars} chars)"
        )
    if malformed:
        reasons.append(f"skipped {malformed} malformed record(s)")
    if no_assistant:
        reasons.append(f"dropped {no_assistant} conversation(s) without an assistant turn")
    skipped = malformed + no_assistant + (stats.tail_line is not None)
    return ReadReport(kept, skipped, turns, "; ".join(reasons) or "complete")


def load_conversations(spec: str, limit: int | None = None) -> tuple[list[list[dict]], ReadReport]:
    """Load chat conversations as normalised message lists (see :func:`normalize_record`).

    ``spec`` is ``"sharegpt"`` (the embedded file), a local ``.jsonl``/``.json``/``.parquet`` file,
    or a Hugging Face dataset name or folder (``datasets.load_dataset``, split ``train``).
    Conversations without a non-empty assistant turn are dropped and counted. A malformed record in
    a user file raises a :class:`DataError` (a ``ValueError``) naming file and line, and so does a
    user source that is empty or has no usable conversation; in the embedded ShareGPT file it is
    skipped and counted. The truncated tail of a JSON array is dropped and reported. ``limit`` caps
    the conversations returned.
    """
    stats = StreamStats()
    source, records, strict = open_records(spec, stats)
    conversations: list[list[dict]] = []
    malformed = no_assistant = turns = seen = 0
    for where, record in as_data_errors(records, source):
        seen += 1
        try:
            messages = normalize_record(record)
        except ValueError as err:
            if strict:
                # a folder's records name their file
                at = where if isinstance(where, str) else f"{source}:{where}"
                raise DataError(f"{at}: {err}. Fix the record or convert the file.") from None
            malformed += 1
            continue
        if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
            no_assistant += 1
            continue
        conversations.append(messages)
        turns += len(messages)
        if limit is not None and len(conversations) >= limit:
            break
    if strict and not conversations and limit != 0:
        raise DataError(
            _nothing_to_train_on(source, seen, malformed, no_assistant, stats.tail_line)
        )
    report = _read_report(len(conversations), turns, malformed, no_assistant, stats)
    logger.info(
        "data %s: %d conversations, %d turns, %d skipped (%s)",
        spec,
        report.kept,
        turns,
        report.skipped,
        report.reason,
    )
    return conversations, report
