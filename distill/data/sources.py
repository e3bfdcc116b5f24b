"""Where ``data=`` records come from: the embedded ShareGPT file, a local ``.jsonl``/``.json``/
``.parquet`` file, a folder of them, or a Hugging Face dataset (name or saved folder), each opened
as ``(where, record)`` pairs; a file that is binary or UTF-16, a missing path, a folder with no data
files and the reader's own errors each become one :class:`DataError` line. What a record means is
:mod:`.conversations`' job.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftsmith.assets import StreamStats, iter_json_records, sharegpt_path
from draftsmith.common.errors import (
    DataError,
    DataFileNotFoundError,
    DraftsmithError,
    MissingDependencyError,
)

logger = logging.getLogger(__name__)


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
        # datasets raises many types (mixed formats, hub, offline, cast
        except Exception as err:  # noqa: BLE001
            raise DataError(
                f"data={spec}: the datasets library cannot load it ({type(err).__name__}: "
                f"{' '.join(str(err).split())[:300]}); {FOLDER_NEEDS}"
            ) from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"]
    yield from enumerate(ds, start=1)


def as_data_errors(
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
        for where, record in as_data_errors(records, path):
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


def open_records(spec: str, stats: StreamStats) -> tuple[Any, Iterator[tuple[int, Any]], bool]:
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
    # a multi-byte character cut by the 4 KiB window is still text
    except UnicodeDecodeError as err:
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
