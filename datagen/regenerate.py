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

from draftsmith.common.errors import InputError
from draftsmith.datagen.batched_generation import batch_support
from draftsmith.datagen.chat_source import (
    iter_conversations,
    normalize_messages,
    select_conversations,
    short_prompts,
)
from draftsmith.datagen.conversation_replies import TURNS, stop_ids
from draftsmith.datagen.regenerate_report import RegenerateReport, summary
from draftsmith.datagen.regeneration_pass import RegenerationPass
from draftsmith.datagen.resumable_jsonl import Progress, disk_full_named, resume_or_start
from draftsmith.runtime.decoding.prompt_limits import context_limit

# greedy first turns decoded at once: the weights are read once per step for 8 tokens
DEFAULT_BATCH_SIZE = 8


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
    job = RegenerateJob(
        data=data,
        out=Path(out),
        target=target,
        limit=limit,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        turns=turns,
        dtype=dtype,
        seed=seed,
        kernels=kernels,
        batch_size=batch_size,
        topic=topic,
        skip=skip,
        max_prompt_tokens=max_prompt_tokens,
        trust_remote_code=trust_remote_code,
    )
    job.check(overwrite)
    return job.run(log or (lambda msg: print(msg, file=sys.stderr, flush=True)))


@dataclass(frozen=True)
class RegenerateJob:
    """The arguments of one :func:`regenerate` call, checked, and the steps of its run."""

    data: str
    out: Path
    target: str | None
    limit: int | None
    max_new_tokens: int
    temperature: float
    top_p: float
    turns: str
    dtype: str
    seed: int
    kernels: str
    batch_size: int
    topic: str
    skip: int
    max_prompt_tokens: int | None
    trust_remote_code: bool

    def check(self, overwrite: bool) -> None:
        """Refuse bad arguments and an ``out`` that is ``data`` or inside the target, before any
        work."""
        from draftsmith import assets
        from draftsmith.common.atomic_folder import check_output_file

        _check_arguments(
            self.turns, self.max_new_tokens, self.limit, self.batch_size, self.max_prompt_tokens
        )
        sources = (
            self.data if Path(self.data).exists() else None,
            self.target and assets.resolve_target(self.target),
        )
        check_output_file(self.out, sources, overwrite)

    def resume_settings(self) -> dict[str, Any]:
        """What a ``.partial`` file must have been written with for a rerun to continue it."""
        settings = {
            "data": self.data,
            "target": self.target,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "turns": self.turns,
            "dtype": self.dtype,
            "seed": self.seed,
            "batch_size": self.batch_size,
        }
        # recorded only when used: a partial file of an older version still resumes
        if self.topic != "all" or self.skip:
            settings.update(topic=self.topic, skip=self.skip)
        if self.max_prompt_tokens is not None:
            settings.update(max_prompt_tokens=self.max_prompt_tokens)
        return settings

    def run(self, log: Callable[[str], None]) -> RegenerateReport:
        """Load the target, regenerate the selected conversations into ``out.partial`` (resuming
        it), then rename it onto ``out``."""
        from draftsmith.runtime.serving import load_runtime

        partial, meta_path = Path(f"{self.out}.partial"), Path(f"{self.out}.partial.json")
        report = RegenerateReport()
        first, conversations = _first_conversation(self.data, self.topic, self.skip, report)
        settings = self.resume_settings()
        report.resumed, last_done = resume_or_start(self.out, partial, meta_path, settings, log)
        rt = load_runtime(
            None, self.target, self.dtype, self.kernels, trust_remote_code=self.trust_remote_code
        )
        kept = short_prompts(
            itertools.chain([first], conversations), rt.tokenizer, self.max_prompt_tokens, report
        )
        items = enumerate(itertools.islice(kept, self.limit), 1)  # (seen, (index, messages))
        progress = Progress(self.count_conversations(rt.tokenizer), log)
        # a full disk: one line
        with disk_full_named(partial), open(partial, "a", encoding="utf-8") as handle:
            run = RegenerationPass(
                rt.model,
                rt.tokenizer,
                stop_ids(rt.tokenizer, rt.eos_ids),
                context_limit(rt.model),
                self.max_new_tokens,
                report,
                progress,
                handle,
                last_done,
                log,
            )
            self.decode(run, rt.model, log, items)
        report.seconds = time.perf_counter() - progress.start
        if report.written + report.resumed == 0:
            raise InputError(
                f"no conversation of {self.data} could be regenerated (skipped: {report.skipped}); "
                f"{partial} is left in place"
            )
        os.replace(partial, self.out)  # atomic: OUT appears only complete
        meta_path.unlink(missing_ok=True)
        return report

    def count_conversations(self, tokenizer: Any) -> int:
        """How many conversations the run will go through (up to the limit): the ETA needs the
        total, and one counting pass over the data costs seconds against hours."""
        counted = select_conversations(iter_conversations(self.data), self.topic, self.skip)
        kept = short_prompts(counted, tokenizer, self.max_prompt_tokens)
        return sum(1 for _ in itertools.islice(kept, self.limit))

    def decode(
        self, run: RegenerationPass, model: Any, log: Callable[[str], None], items: Iterator
    ) -> None:
        """Batched greedy first turns where the mode and the decoder allow it, else one by one."""
        if _batched(self.batch_size, self.turns, self.temperature, model, log):
            run.batched(items, self.batch_size)
        else:
            run.one_by_one(items, self.turns, self.temperature, self.top_p, self.seed)


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


__all__ = [
    "RegenerateJob",
    "RegenerateReport",
    "iter_conversations",
    "normalize_messages",
    "regenerate",
    "summary",
]
