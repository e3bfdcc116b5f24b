"""Prompt sets: the one loader and the one grammar every command that reads prompts uses (bench,
evaluations, ``draftsmith trajectories``, the served-tau probe, the learning curve).

A spec names a prompt set::

    SPEC   := SOURCE | SOURCE[START:STOP]
    SOURCE := mtbench     the first turns of the 80 bundled MT-Bench questions
            | humaneval   the 164 bundled HumanEval problems
            | sharegpt    the first human turn of each prepared ShareGPT conversation
            | PATH        a file: ``.txt`` holds one prompt per non-blank line; any other file
                          (``.jsonl``) one JSON object per line with a ``prompt`` string or
                          MT-Bench's ``turns`` list (its first turn is the prompt)

``[START:STOP]`` takes those prompts of the source, as a Python slice with whole numbers, either
one left out (``mtbench[40:]``: the prompts a bench on the first 40 never sees). An existing file
always wins: a file whose name ends in ``[a:b]`` is that file. Every spec that names nothing (no
such set or file, a folder, a binary file, a bad line, a malformed or empty slice) is refused in
one line naming it, before any tokenizer or model work.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from draftsmith import assets
from draftsmith.common.chat import encode_chat
from draftsmith.common.errors import InputError, InputNotFoundError

SETS = ("mtbench", "humaneval", "sharegpt")
SLICE = re.compile(r"^(?P<name>.+)\[(?P<start>\d*):(?P<stop>\d*)\]$")
BRACKETS = re.compile(r"^(?P<name>.+)\[(?P<inner>[^\]]*)\]$")
FILE_FORMS = '.jsonl with one {"prompt": "..."} per line, or a .txt with one prompt per line'


def prompt_texts(spec: str, limit: int | None = None) -> list[str]:
    """The prompt texts ``spec`` names (the grammar above), in order, at most ``limit`` of them
    (an empty file gives none); a spec that names nothing, or a ``limit`` below 1, is one line
    naming it. No tokenizer or model is needed, so a command checks its prompts before any work."""
    if limit is not None and limit < 1:  # 0 would mean "all" and -N "all but N": refuse both
        raise InputError(
            f"the number of prompts must be >= 1, got {limit} (leave it out to use every prompt)"
        )
    if Path(spec).is_file():  # a file whose name ends in [a:b] is a file
        texts = _source_texts(spec, limit)
    else:
        texts = _sliced_texts(spec, limit)
    return texts[:limit] if limit else texts


def encode_prompts(spec: str, tokenizer: Any, limit: int | None = None) -> list[list[int]]:
    """The prompts ``spec`` names as chat token ids; a spec that holds no prompt is refused in one
    line."""
    return encode_texts(spec, prompt_texts(spec, limit), tokenizer)


def encode_texts(spec: str, texts: list[str], tokenizer: Any) -> list[list[int]]:
    """``texts`` (the prompts of ``spec``) as chat token ids: the target's chat template, one user
    turn, then the assistant generation prompt (:func:`draftsmith.common.chat.encode_chat`)."""
    if not texts:
        raise InputError(f"no prompts in {spec}")
    return [encode_chat(tokenizer, text) for text in texts]


def check_spec(spec: str) -> None:
    """Refuse, in one line, a spec with a malformed slice or that names no set and no file, without
    reading any prompt (cheap: a command checks it before loading its model)."""
    if Path(spec).is_file():
        return
    name, _, _ = _split_slice(spec)
    if name not in SETS and not Path(name).is_file():
        _refuse_path(Path(name))


def _split_slice(spec: str) -> tuple[str, int, int | None]:
    """``(source, start, stop)`` of ``SOURCE[START:STOP]`` (``(spec, 0, None)`` without a slice);
    a bracket that is not a slice of whole numbers is refused."""
    sliced, bracketed = SLICE.match(spec), BRACKETS.match(spec)
    if bracketed and not sliced:
        raise InputError(
            f"prompts {spec}: a slice is NAME[START:STOP] with whole numbers, e.g. mtbench[40:] or "
            f"humaneval[0:20]; got [{bracketed['inner']}]"
        )
    if not sliced:
        return spec, 0, None
    stop = int(sliced["stop"]) if sliced["stop"] else None
    return sliced["name"], int(sliced["start"] or 0), stop


def _sliced_texts(spec: str, limit: int | None) -> list[str]:
    """The texts of a set name or path with an optional ``[START:STOP]``."""
    name, start, stop = _split_slice(spec)
    if name == spec:
        return _source_texts(spec, limit)
    # a set read lazily (sharegpt) needs only the prompts up to the slice's end
    ends = [end for end in (stop, None if limit is None else start + limit) if end is not None]
    texts = _source_texts(name, min(ends) if ends else None)
    if not texts[start:stop]:
        shown = "" if stop is None else stop
        raise InputError(
            f"prompts {spec} selects no prompts: {name} has {len(texts)}, and [{start}:{shown}] is"
            " empty"
        )
    return texts[start:stop]


def _refuse_path(path: Path) -> None:
    """The one line for a source that is neither a prompt set nor a file."""
    if path.is_dir():
        raise InputError(
            f"prompts {path} is a folder: pass a {FILE_FORMS}, or a prompt set ({', '.join(SETS)})"
        )
    raise InputNotFoundError(
        f"prompts {path}: no such file, and not a prompt set ({', '.join(SETS)}); pass a "
        f"{FILE_FORMS}"
    )


def _source_texts(source: str, needed: int | None) -> list[str]:
    """Every prompt text of a set or file, in order (``sharegpt``: the first ``needed`` ones when
    given, as reading the whole file takes a while)."""
    if source == "mtbench":
        return [q["turns"][0] for q in assets.mtbench_questions()]
    if source == "humaneval":
        return assets.humaneval_prompts()
    if source == "sharegpt":
        conversations, _ = assets.read_sharegpt(assets.sharegpt_path(), limit=needed)
        return [c["conversations"][0]["value"] for c in conversations if c["conversations"]]
    path = Path(source)
    if not path.is_file():
        _refuse_path(path)
    lines = _text_of(path).splitlines()
    if path.suffix == ".txt":
        return [line.strip() for line in lines if line.strip()]
    return [_record_text(path, n, line) for n, line in enumerate(lines, 1) if line.strip()]


def _text_of(path: Path) -> str:
    """The file's text; a file that is not UTF-8 text (a binary, an image, a checkpoint) is named
    with the fix."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(
            f"prompts file {path} is not UTF-8 text (byte {err.start} is {data[err.start]:#04x}; a "
            f"binary file?): pass a {FILE_FORMS}, or {' / '.join(SETS)}"
        ) from None


def _record_text(path: Path, n: int, line: str) -> str:
    """The prompt of JSON line ``n`` of ``path``: its ``prompt``, else its first ``turns``."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise InputError(f"{path}:{n}: not valid JSON ({err})") from err
    if not isinstance(record, dict):
        raise InputError(
            f"{path}:{n}: a JSON {type(record).__name__}, not an object: each line needs "
            '{"prompt": "..."} (or MT-Bench\'s {"turns": [...]})'
        )
    text = record.get("prompt") or (record.get("turns") or [None])[0]
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"{path}:{n}: needs a non-empty 'prompt' string or a 'turns' list")
    return text
