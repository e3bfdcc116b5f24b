"""``draftsmith regenerate``: rewrite the assistant turns of a chat dataset with the target itself
(self-distillation).

EAGLE-3 and Medusa-2 style drafters learn best from text the target would write. This module replays
each conversation through the runtime decoder: system and user turns are kept, each assistant turn
(the first only, or all of them with the target's own earlier replies in context) is replaced by the
target's generation from the chat template with the generation prompt. The output is JSON lines
``{"messages": [...], "source_index": i}`` that ``data.spec=OUT.jsonl`` reads.

Batches: greedy first turns decode ``batch_size`` conversations at once (default 8;
:mod:`draftsmith.datagen.batched_generation`), a 135M target being memory-bound at batch 1.
Conversations go in chunks of ``CHUNK_ROWS * batch_size`` formed from the source order alone, and
each reply is written once the replies before it are. ``--turns all``, sampling and decoders without
a batched step decode one conversation at a time, with a log line saying why.

Crash safety (:mod:`draftsmith.datagen.resumable_jsonl`): lines are appended and flushed to
``OUT.jsonl.partial`` (settings, batch size included, in ``OUT.jsonl.partial.json``); a rerun with
the same settings continues after the last complete line (redoing the chunk it stopped in), and the
finished file is renamed onto ``OUT.jsonl`` with ``os.replace``. Sampling uses one generator per
conversation seeded from ``seed`` and the source index, so a resumed run writes the same bytes as an
uninterrupted one.

Over-long conversations: a conversation whose prompt does not fit in the target's context
(``max_position_embeddings``) is skipped before any model work, with a log line naming its source
index, its token count and the limit, and counted in the summary. Skipping rather than failing:
regenerating a dataset is a long batch job in which a few over-long records are normal (ShareGPT has
some); stopping would throw the run's progress at the user and, on resume, stop at the same record
again.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.common.chat import encode_chat
from draftsmith.common.errors import InputError
from draftsmith.datagen.batched_generation import batch_support, generate_greedy_batch
from draftsmith.datagen.chat_source import (
    iter_conversations,
    normalize_messages,
    reply_slots,
    select_conversations,
    short_prompts,
    turns_before,
)
from draftsmith.datagen.regenerate_report import RegenerateReport, summary
from draftsmith.datagen.resumable_jsonl import (
    Progress,
    append_line,
    disk_full_named,
    resume_or_start,
)
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.prompt_limits import check_prompt_fits, context_limit

TURNS = ("first", "all")
DEFAULT_BATCH_SIZE = (
    8  # greedy first turns decoded at once: the weights are read once per step for 8 tokens
)
CHUNK_ROWS = 16  # conversations per batch row in one chunk: a resume redoes at most one chunk


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
        out = context_msgs + [_reply(tokenizer, tokens)]
        cursor, done = slot + 1, done + 1
    if not any(m["role"] == "assistant" and m["content"] for m in out):
        return None, total, "empty reply"
    return out, total, None


def _reply(tokenizer: Any, tokens: list[int]) -> dict[str, str]:
    return {
        "role": "assistant",
        "content": tokenizer.decode(tokens, skip_special_tokens=True).strip(),
    }


def regenerate(
    data: str,
    out: str | Path,
    target: str | None = None,
    limit: int | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    turns: str = "first",
    dtype: str = "bf16",
    seed: int = 0,
    kernels: str = "auto",
    log: Callable[[str], None] | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    topic: str = "all",
    skip: int = 0,
    max_prompt_tokens: int | None = None,
    overwrite: bool = False,
    trust_remote_code: bool = False,
) -> RegenerateReport:
    """Regenerate ``data`` with the target and write ``out`` (jsonl), resuming an interrupted
    ``out.partial``.

    ``batch_size`` > 1 decodes that many greedy first turns at once
    (:mod:`draftsmith.datagen.batched_generation`); ``turns="all"``, sampling and decoders without a
    batched step decode one conversation at a time (logged). ``topic`` / ``skip``: only
    conversations on that topic, from source index ``skip`` on (``select_conversations``);
    ``max_prompt_tokens``: only conversations whose first reply's prompt has at most that many
    tokens, skipped before any model work (a run that trains at ``data.max_length`` L learns nothing
    from a reply behind a prompt of ~L tokens, and its prefill is most of batched regeneration's
    time); ``limit`` counts the selected ones. ``out`` must be a new file (or ``overwrite``), never
    ``data`` or inside the target: checked before any work.
    ``trust_remote_code``: let a target folder's own code run (off by default)."""
    from draftsmith import assets
    from draftsmith.common.atomic_folder import check_output_file
    from draftsmith.runtime.serving import load_runtime

    _check_arguments(turns, max_new_tokens, limit, batch_size, max_prompt_tokens)
    check_output_file(
        out,
        (data if Path(data).exists() else None, target and assets.resolve_target(target)),
        overwrite,
    )
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    out = Path(out)
    partial, meta_path = Path(f"{out}.partial"), Path(f"{out}.partial.json")
    report = RegenerateReport()
    first, conversations = _first_conversation(data, topic, skip, report)
    settings = {
        "data": data,
        "target": target,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "turns": turns,
        "dtype": dtype,
        "seed": seed,
        "batch_size": batch_size,
    }
    if (
        topic != "all" or skip
    ):  # recorded only when used: a partial file of an older version still resumes
        settings.update(topic=topic, skip=skip)
    if max_prompt_tokens is not None:
        settings.update(max_prompt_tokens=max_prompt_tokens)
    report.resumed, last_done = resume_or_start(out, partial, meta_path, settings, log)
    rt = load_runtime(None, target, dtype, kernels, trust_remote_code=trust_remote_code)
    # The ETA needs the total: one counting pass over the data (up to the limit), seconds against
    # hours.
    counted = select_conversations(iter_conversations(data), topic, skip)
    total = sum(
        1 for _ in itertools.islice(short_prompts(counted, rt.tokenizer, max_prompt_tokens), limit)
    )
    kept = short_prompts(
        itertools.chain([first], conversations), rt.tokenizer, max_prompt_tokens, report
    )
    items = enumerate(itertools.islice(kept, limit), 1)  # (seen, (index, messages))
    with (
        disk_full_named(partial),
        open(partial, "a", encoding="utf-8") as handle,
    ):  # a full disk: one line
        run = _Run(
            rt.model,
            rt.tokenizer,
            stop_ids(rt.tokenizer, rt.eos_ids),
            context_limit(rt.model),
            max_new_tokens,
            report,
            Progress(total, log),
            handle,
            last_done,
            log,
        )
        if _batched(batch_size, turns, temperature, rt.model, log):
            run.batched(items, batch_size)
        else:
            run.one_by_one(items, turns, temperature, top_p, seed)
    report.seconds = time.perf_counter() - run.progress.start
    if report.written + report.resumed == 0:
        raise InputError(
            f"no conversation of {data} could be regenerated (skipped: {report.skipped}); "
            f"{partial} is left in place"
        )
    os.replace(partial, out)  # atomic: OUT appears only complete
    meta_path.unlink(missing_ok=True)
    return report


def _first_conversation(
    data: str, topic: str, skip: int, report: RegenerateReport
) -> tuple[Any, Iterator]:
    """(the first selected conversation, the rest): empty or binary data fails here, before the
    (slow) model load."""
    conversations = select_conversations(iter_conversations(data, report), topic, skip)
    try:
        first = next(conversations, None)
    except UnicodeDecodeError as err:
        raise InputError(
            f"--data {data} is not UTF-8 text ({err.reason}: a binary file?): pass a .jsonl/.json"
            " of conversations, or sharegpt"
        ) from None
    if first is None:
        where = (
            ""
            if topic == "all" and not skip
            else f" on topic {topic!r} from source index {skip} on"
        )
        raise InputError(
            f"no conversations in {data}{where}: expected records with 'conversations' or"
            " 'messages'"
        )
    return first, conversations


def _check_arguments(
    turns: str,
    max_new_tokens: int,
    limit: int | None,
    batch_size: int = 1,
    max_prompt_tokens: int | None = None,
) -> None:
    """Refuse an unknown ``--turns`` mode and a non-positive ``--max-new-tokens``, ``--limit``,
    ``--batch-size`` or ``--max-prompt-tokens``."""
    if turns not in TURNS:
        raise InputError(f"--turns must be one of {', '.join(TURNS)}, got {turns!r}")
    if max_new_tokens < 1 or (limit is not None and limit < 1):
        raise InputError("--max-new-tokens and --limit must be >= 1")
    if batch_size < 1:
        raise InputError(
            f"--batch-size must be >= 1 (1 decodes one conversation at a time), got {batch_size}"
        )
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise InputError(
            "--max-prompt-tokens must be >= 1 (or left out: every prompt that fits the context), "
            f"got {max_prompt_tokens}"
        )


def _batched(
    batch_size: int, turns: str, temperature: float, model: Any, log: Callable[[str], None]
) -> bool:
    """Whether to decode in batches; when ``batch_size`` > 1 cannot be honoured, one log line says
    why."""
    if batch_size == 1:
        return False
    why = (
        "--turns all needs each reply before the next turn's prompt"
        if turns == "all"
        else (
            "sampling draws from one generator per conversation (that keeps it resumable)"
            if temperature > 0
            else batch_support(model)
        )
    )
    if why is not None:
        log(f"--batch-size {batch_size}: {why}; decoding one conversation at a time")
    return why is None


@dataclass
class _Run:
    """One regeneration pass writing ``handle`` (the .partial file) in source order after
    ``last_done``."""

    model: Any
    tokenizer: Any
    eos: tuple[int, ...]
    context: int | None
    max_new_tokens: int
    report: RegenerateReport
    progress: Progress
    handle: Any
    last_done: int
    log: Callable[[str], None]

    def _note(self, seen: int, index: int) -> bool:
        """True when source conversation ``index`` is still to do (earlier ones were written before
        a resume)."""
        if index <= self.last_done:
            self.progress.resumed_before = seen
        return index > self.last_done

    def _emit(self, seen: int, index: int, messages: list[dict] | None, note: str | None) -> None:
        if messages is None:
            self.report.skip(note or "skipped")
            return
        append_line(self.handle, {"messages": messages, "source_index": index})
        self.report.written += 1
        self.progress.tick(seen, self.report.written + self.report.resumed, self.report.tokens)

    def one_by_one(
        self, items: Iterator, turns: str, temperature: float, top_p: float, seed: int
    ) -> None:
        """Batch 1: each conversation through :func:`regenerate_conversation` (every mode, sampling
        included)."""
        for seen, (index, messages) in items:
            if not self._note(seen, index):
                continue
            generator = torch.Generator().manual_seed(
                seed * 1_000_003 + index
            )  # per conversation: resumable
            new, tokens, note = regenerate_conversation(
                self.model,
                self.tokenizer,
                messages,
                turns,
                self.max_new_tokens,
                temperature,
                top_p,
                self.eos,
                generator,
                self.context,
                f"conversation {index}",
                self.log,
            )
            self.report.tokens += tokens
            self.report.truncated += note == "truncated"
            self._emit(seen, index, new, note)

    def batched(self, items: Iterator, batch_size: int) -> None:
        """Greedy first turns, ``batch_size`` rows at once, in chunks of ``CHUNK_ROWS * batch_size``
        conversations formed from the source order alone: a resumed run redoes the chunk it stopped
        in the same way, so it writes the same bytes as an uninterrupted one."""
        chunk: list[
            tuple[int, int, list[dict], list[int], int]
        ] = []  # (seen, index, context, prompt, budget)
        for seen, (index, messages) in items:
            todo = self._note(seen, index)
            plan = first_turn_prompt(
                self.tokenizer,
                messages,
                self.max_new_tokens,
                self.context,
                f"conversation {index}",
                self.log if todo else None,
            )
            if isinstance(plan, str):
                if todo:
                    self.report.skip(plan)
                continue
            chunk.append((seen, index, *plan))
            if len(chunk) == CHUNK_ROWS * batch_size:
                self._chunk(chunk, batch_size)
                chunk = []
        if chunk:
            self._chunk(chunk, batch_size)

    def _chunk(
        self, chunk: list[tuple[int, int, list[dict], list[int], int]], batch_size: int
    ) -> None:
        """Decode one chunk; each reply is written as soon as every earlier one of the chunk is
        (source order)."""
        if chunk[-1][1] <= self.last_done:
            return  # written before the interruption
        replies: dict[int, list[int]] = {}
        first_unwritten = [0]  # position in the chunk

        def done(i: int, tokens: list[int]) -> None:
            replies[i] = tokens
            self.report.tokens += len(tokens)
            while first_unwritten[0] in replies:
                seen, index, context_msgs, _, _ = chunk[first_unwritten[0]]
                reply = _reply(self.tokenizer, replies.pop(first_unwritten[0]))
                if index > self.last_done:
                    self._emit(
                        seen,
                        index,
                        context_msgs + [reply] if reply["content"] else None,
                        "empty reply",
                    )
                first_unwritten[0] += 1

        generate_greedy_batch(
            self.model, [c[3] for c in chunk], [c[4] for c in chunk], self.eos, batch_size, done
        )


__all__ = [
    "RegenerateReport",
    "first_turn_prompt",
    "iter_conversations",
    "normalize_messages",
    "regenerate",
    "regenerate_conversation",
    "render_prompt",
    "stop_ids",
    "summary",
]
