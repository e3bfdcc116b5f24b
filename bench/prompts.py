"""Prompt sets for benches and evaluations: MT-Bench, HumanEval or a jsonl file, chat-encoded."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from draftsmith import assets
from draftsmith.common.chat import encode_chat
from draftsmith.common.errors import InputError, InputNotFoundError
from draftsmith.runtime.decoding.prompt_limits import check_prompt_fits

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _text_of(path: Path) -> str:
    """The file's text; a file that is not UTF-8 text (a binary, an image, a checkpoint) is named
    with the fix."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(
            f"prompts file {path} is not UTF-8 text (byte {err.start} is {data[err.start]:#04x}; a "
            'binary file?): pass a .jsonl with one {"prompt": "..."} per line, or mtbench / '
            "humaneval"
        ) from None


SLICE = re.compile(r"^(?P<name>.+)\[(?P<start>\d*):(?P<stop>\d*)\]$")
BRACKETS = re.compile(r"^(?P<name>.+)\[(?P<inner>[^\]]*)\]$")
SETS = ("mtbench", "humaneval")


def prompt_texts(spec: str) -> list[str]:
    """The prompt texts ``spec`` names (``mtbench``, ``humaneval``, a jsonl file, each with an
    optional ``[a:b]`` slice), in order; a spec that names nothing (no such set or file, a folder, a
    malformed or empty slice) is one line naming it. No tokenizer or model is needed, so a command
    checks its prompts before any work.
    """
    if Path(spec).is_file():  # a file whose name ends in [a:b] is a file
        return _texts(spec)
    sliced, bracketed = SLICE.match(spec), BRACKETS.match(spec)
    if bracketed and not sliced:
        raise InputError(
            f"prompts {spec}: a slice is NAME[START:STOP] with whole numbers, e.g. mtbench[40:] or "
            f"humaneval[0:20]; got [{bracketed['inner']}]"
        )
    if not sliced:
        return _texts(spec)
    texts = _texts(sliced["name"])
    start, stop = int(sliced["start"] or 0), int(sliced["stop"]) if sliced["stop"] else len(texts)
    if not texts[start:stop]:
        raise InputError(
            f"prompts {spec} selects no prompts: {sliced['name']} has {len(texts)}, and [{start}:"
            f"{sliced['stop']}] is empty"
        )
    return texts[start:stop]


def load_prompts(
    spec: str, tokenizer: PreTrainedTokenizerBase, limit: int | None, max_len: int | None = None
) -> list[list[int]]:
    """``mtbench`` (first turns of the 80 questions), ``humaneval`` (the 164 problems as chat
    prompts) or a jsonl with ``prompt`` or MT-Bench ``turns``; ``NAME[a:b]`` takes those prompts of
    the set (``mtbench[40:]``: prompts a bench on the first ones never sees, for choosing
    checkpoints on). With ``max_len`` (the target's context), a prompt that cannot fit fails at
    once, named, before any model work."""
    if limit is not None and limit < 1:  # 0 would mean "all" and -N "all but N" below: refuse both
        raise InputError(
            f"the number of prompts must be >= 1, got {limit} (leave it out to use every prompt)"
        )
    texts = prompt_texts(spec)
    texts = texts[:limit] if limit else texts
    if not texts:
        raise InputError(f"no prompts in {spec}")
    encoded = [encode_chat(tokenizer, t) for t in texts]
    for n, ids in enumerate(encoded, 1):
        if max_len is not None:
            check_prompt_fits(len(ids), max_len, f"prompt {n} of {spec} ({texts[n - 1][:40]!r}...)")
    return encoded


def _texts(spec: str) -> list[str]:
    """Every prompt text of ``mtbench``, ``humaneval`` or a jsonl file, in order."""
    if spec == "mtbench":
        texts = [q["turns"][0] for q in assets.mtbench_questions()]
    elif spec == "humaneval":
        texts = assets.humaneval_prompts()
    else:
        path = Path(spec)
        if path.is_dir():
            raise InputError(
                f'prompts {path} is a folder: pass a .jsonl file with one {{"prompt": "..."}} per '
                f"line, or a prompt set ({', '.join(SETS)})"
            )
        if not path.is_file():
            raise InputNotFoundError(
                f"prompts {path}: no such file, and not a prompt set ({', '.join(SETS)}); pass "
                "a .jsonl with a 'prompt' field per line"
            )
        texts = []
        for n, line in enumerate(_text_of(path).splitlines(), 1):
            if not line.strip():
                continue
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
            texts.append(text)
    return texts
