"""One regeneration pass: the conversations still to do, decoded one by one (every mode, sampling
included) or as batched greedy first turns in chunks, each reply appended to the ``.partial`` file
in source order after the last line an interrupted run wrote."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from draftsmith.datagen.batched_generation import generate_greedy_batch
from draftsmith.datagen.conversation_replies import (
    first_turn_prompt,
    regenerate_conversation,
    reply_message,
)
from draftsmith.datagen.regenerate_report import RegenerateReport
from draftsmith.datagen.resumable_jsonl import Progress, append_line

CHUNK_ROWS = 16  # conversations per batch row in one chunk: a resume redoes at most one chunk


@dataclass
class RegenerationPass:
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
                reply = reply_message(self.tokenizer, replies.pop(first_unwritten[0]))
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
