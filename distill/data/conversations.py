"""Chat conversations from the embedded ShareGPT file, local jsonl/json/parquet files or HF
datasets, normalised to ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftsmith.assets import ReadReport, StreamStats, iter_json_records, sharegpt_path
from draftsmith.common.errors import (
    DataError,
    DataFileNotFoundError,
    DraftsmithError,
    MissingDependencyError,
)

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


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise MissingDependencyError(f"reading {path} needs pyarrow: pip install pyarrow") from err
    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            row += 1
            yield row, record


# What `datasets` reads from a plain folder (its packaged builders), and what such a folder must
# hold.
DATA_SUFFIXES = frozenset({".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt"})
FOLDER_NEEDS = (
    "a data folder must contain .jsonl, .json or .parquet files of chat conversations (ShareGPT "
    "'conversations' or OpenAI 'messages' records), or be a folder written by Dataset.save_to_disk"
)


def _iter_hf_dataset(spec: str) -> Iterator[tuple[int, Any]]:
    try:
        import datasets
    except ImportError as err:
        raise MissingDependencyError(
            f"data={spec!r} is not a local file, and loading it as a Hugging Face "
            "dataset needs `pip install datasets`"
        ) from err
    local = Path(spec).expanduser()
    if (
        local.is_dir()
        and (local / "dataset_info.json").is_file()
        and (local / "state.json").is_file()
    ):
        ds = datasets.load_from_disk(str(local))  # a folder written by Dataset.save_to_disk
    else:
        if local.is_dir() and not any(
            p.suffix in DATA_SUFFIXES for p in local.rglob("*") if p.is_file()
        ):
            raise DataError(f"data folder {local} holds no data files: {FOLDER_NEEDS}")
        try:
            ds = datasets.load_dataset(spec, split="train")
        except (
            datasets.exceptions.DataFilesNotFoundError,
            datasets.data_files.EmptyDatasetError,
        ) as err:
            raise DataError(f"data={spec}: {' '.join(str(err).split())}; {FOLDER_NEEDS}") from None
        except Exception as err:  # noqa: BLE001 - datasets raises many types (mixed formats, hub, offline, cast)
            raise DataError(
                f"data={spec}: the datasets library cannot load it ({type(err).__name__}: "
                f"{' '.join(str(err).split())[:300]}); {FOLDER_NEEDS}"
            ) from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"]
    yield from enumerate(ds, start=1)


def _as_data_errors(
    records: Iterator[tuple[int, Any]], source: Any = None
) -> Iterator[tuple[int, Any]]:
    """The reader's own ``ValueError`` (invalid JSON at a line) is a problem of the user's file:
    re-raise it as a :class:`DataError` so the command line prints it as one line (naming ``source``
    where the reader did not).
    """
    try:
        yield from records
    except DraftsmithError:
        raise
    except UnicodeDecodeError as err:
        raise DataError(
            f"data file {source} is not UTF-8 text ({err.reason} at byte {err.start}): is it a"
            " binary file? Point data= at a .jsonl/.json/.parquet file of chat conversations"
        ) from err
    except ValueError as err:
        raise DataError(
            str(err) if source is None or str(source) in str(err) else f"{source}: {err}"
        ) from err


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


NATIVE_SUFFIXES = (".jsonl", ".json", ".parquet")


def _folder_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """The chat files of a data folder (``.jsonl``/``.json``/``.parquet``, sorted, hidden ones left
    out) and the other files in it."""
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )
    return [p for p in files if p.suffix.lower() in NATIVE_SUFFIXES], [
        p for p in files if p.suffix.lower() not in NATIVE_SUFFIXES
    ]


def _iter_folder(folder: Path, files: list[Path], stats: StreamStats) -> Iterator[tuple[str, Any]]:
    """Every record of every chat file of ``folder``, in file order; ``where`` is ``FILE:LINE`` (or
    ``FILE:ROW``)."""
    for path in files:
        if path.suffix.lower() == ".parquet":
            records: Iterator[tuple[int, Any]] = _iter_parquet(path)
        else:
            _refuse_binary(path)
            records = iter_json_records(path, stats)
        for where, record in _as_data_errors(records, path):
            yield f"{path}:{where}", record


def _open_folder(folder: Path, stats: StreamStats) -> Iterator[tuple[Any, Any]] | None:
    """The records of a local folder of chat files, read here (``datasets`` reads one format of a
    mixed folder and drops the rest without a word); files of other kinds are named in one warning
    and skipped. None when the folder holds no chat file (``datasets`` may read its csv/arrow/txt
    files)."""
    chats, others = _folder_files(folder)
    if not chats:
        return None
    if others:
        names = ", ".join(str(p.relative_to(folder)) for p in others[:5]) + (
            " ..." if len(others) > 5 else ""
        )
        logger.warning(
            "data folder %s: skipping %d file(s) that are not .jsonl/.json/.parquet: %s",
            folder,
            len(others),
            names,
        )
    return _iter_folder(folder, chats, stats)


def _open_records(spec: str, stats: StreamStats) -> tuple[Any, Iterator[tuple[int, Any]], bool]:
    """The source named by ``spec`` (a path, or ``spec`` itself for a Hugging Face dataset), its
    ``(where, record)`` iterator, and whether a malformed record is an error (``strict``: every user
    source, not the embedded file).
    """
    if spec.strip().lower() == "sharegpt":
        source: Any = sharegpt_path()
        # the embedded dump has a few odd records; count them instead of failing
        return source, iter_json_records(source, stats), False
    source = Path(spec).expanduser()
    suffix = source.suffix.lower()
    if suffix in (".json", ".jsonl", ".parquet") and not source.is_file():
        raise DataFileNotFoundError(f"data file {source} does not exist")
    if source.is_file() and suffix in (".json", ".jsonl"):
        _refuse_binary(source)
        return source, iter_json_records(source, stats), True
    if source.is_file() and suffix == ".parquet":
        return source, _iter_parquet(source), True
    if source.is_file():
        raise DataError(f"unsupported data file {source}: use .jsonl, .json or .parquet")
    if looks_like_path(spec) and not source.exists():
        raise DataFileNotFoundError(
            f"data path {source} does not exist (data= takes a .jsonl/.json/.parquet file, a "
            "saved dataset folder or a Hugging Face dataset name)"
        )
    saved = (source / "dataset_info.json").is_file() and (source / "state.json").is_file()
    if source.is_dir() and not saved and (records := _open_folder(source, stats)) is not None:
        return source, records, True
    return spec, _iter_hf_dataset(spec), True


def looks_like_path(spec: str) -> bool:
    """Whether ``spec`` is meant as a local path rather than a hub dataset id (``org/name``):
    absolute, ``./``, ``~``, a Windows drive, or more than one ``/``."""
    return (
        spec.startswith(("/", ".", "~", "\\"))
        or (len(spec) > 1 and spec[1] == ":")
        or spec.count("/") > 1
    )


def _refuse_binary(path: Path) -> None:
    """A file named .json/.jsonl whose first bytes are not text (a parquet, an archive, model
    weights, ...)."""
    with open(path, "rb") as fh:
        head = fh.read(4096)
    try:
        head.decode("utf-8")
        text_like = b"\0" not in head
    except (
        UnicodeDecodeError
    ) as err:  # a multi-byte character cut by the 4 KiB window is still text
        text_like = b"\0" not in head and err.start >= len(head) - 3
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DataError(
            f"data file {path} is UTF-16 text: save it as UTF-8 (one JSON object per line, or a"
            " JSON array of chat conversations)"
        )
    if not text_like:
        kind = " (it is a parquet file: rename it to .parquet)" if head.startswith(b"PAR1") else ""
        raise DataError(
            f"data file {path} is binary, not JSON text{kind}; point data= at a"
            " .jsonl/.json/.parquet file of chat conversations"
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
    source, records, strict = _open_records(spec, stats)
    conversations: list[list[dict]] = []
    malformed = no_assistant = turns = seen = 0
    for where, record in _as_data_errors(records, source):
        seen += 1
        try:
            messages = normalize_record(record)
        except ValueError as err:
            if strict:
                at = (
                    where if isinstance(where, str) else f"{source}:{where}"
                )  # a folder's records name their file
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
