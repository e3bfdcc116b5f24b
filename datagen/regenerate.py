"""``draftsmith regenerate``: rewrite the assistant turns of a chat dataset with the target itself (self-distillation).

EAGLE-3 and Medusa-2 style drafters learn best from text the target would write. This module replays each
conversation through the runtime decoder: system and user turns are kept, each assistant turn (the first only,
or all of them with the target's own earlier replies in context) is replaced by the target's generation from the
chat template with the generation prompt. The output is JSON lines ``{"messages": [...], "source_index": i}``
that ``data.spec=OUT.jsonl`` reads.

Crash safety: lines are appended and flushed to ``OUT.jsonl.partial`` (settings in ``OUT.jsonl.partial.json``);
a rerun with the same settings continues after the last complete line, and the finished file is renamed onto
``OUT.jsonl`` with ``os.replace``. Sampling uses one generator per conversation seeded from ``seed`` and the
source index, so a resumed run writes the same bytes as an uninterrupted one.

Over-long conversations: a conversation whose prompt does not fit in the target's context
(``max_position_embeddings``) is skipped before any model work, with a log line naming its source index, its token
count and the limit, and counted in the summary. Skipping rather than failing: regenerating a dataset is a long batch
job in which a few over-long records are normal (ShareGPT has some); stopping would throw the run's progress at the
user and, on resume, stop at the same record again.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsmith import assets
from draftsmith.common.chat import encode_chat
from draftsmith.common.durations import eta_seconds, format_duration
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.prompt_limits import check_prompt_fits, context_limit

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}
TURNS = ("first", "all")


@dataclass
class RegenerateReport:
    """What a run did; ``skipped`` maps a reason to a count of conversations not written."""

    written: int = 0
    resumed: int = 0  # lines already in the .partial file when the run started
    truncated: int = 0  # "all" mode: later turns cut because the context was full
    tokens: int = 0
    seconds: float = 0.0
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def normalize_messages(record: Any) -> list[dict[str, str]]:
    """ShareGPT ``conversations: [{from, value}]`` or OpenAI ``messages: [{role, content}]`` -> role/content dicts."""
    turns = None
    if isinstance(record, dict):
        turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        raise ValueError("expected a 'conversations' (ShareGPT) or 'messages' (OpenAI) list")
    out = []
    for i, turn in enumerate(turns):
        role = ROLES.get(str(turn.get("role", turn.get("from"))).lower()) if isinstance(turn, dict) else None
        content = turn.get("content", turn.get("value")) if isinstance(turn, dict) else None
        if role is None or not isinstance(content, str | None):
            raise ValueError(f"message {i} needs a known role ({', '.join(sorted(ROLES))}) and string content")
        out.append({"role": role, "content": content or ""})
    return out


def iter_conversations(spec: str, report: RegenerateReport | None = None) -> Iterator[tuple[int, list[dict]]]:
    """Yield ``(source_index, messages)`` from ``"sharegpt"`` (embedded) or a local .jsonl/.json file.

    ``source_index`` is the 0-based record position in the file. Malformed records fail with file:line in a user
    file and are skipped (counted in ``report``) in the embedded dump.
    """
    embedded = spec.strip().lower() == "sharegpt"
    path = assets.sharegpt_path() if embedded else Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist; pass --data sharegpt or a .jsonl/.json of "
                                "conversations")
    for index, (line, record) in enumerate(assets.iter_json_records(path)):
        try:
            yield index, normalize_messages(record)
        except ValueError as err:
            if not embedded:
                raise ValueError(f"{path}:{line}: {err}. Fix the record or remove it.") from None
            if report is not None:
                report.skip("malformed record")


def render_prompt(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` in the target's chat template followed by the assistant generation prompt (the
    encoding training and bench use: :func:`draftsmith.common.chat.encode_chat`)."""
    return encode_chat(tokenizer, messages)


def stop_ids(tokenizer: Any, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    """EOS ids of the target plus the tokenizer's EOS and common end-of-turn tokens present in its vocabulary."""
    vocab = tokenizer.get_vocab()
    ends = [t for t in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>") if t in vocab]
    extra = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return tuple(dict.fromkeys([*eos_ids, *extra, *(vocab[t] for t in ends)]))


def regenerate_conversation(
    model: Any, tokenizer: Any, messages: list[dict], turns: str = "first", max_new_tokens: int = 256,
    temperature: float = 0.0, top_p: float = 1.0, eos_ids: tuple[int, ...] = (),
    generator: torch.Generator | None = None, context: int | None = None, what: str = "the conversation",
    log: Callable[[str], None] | None = None,
) -> tuple[list[dict] | None, int, str | None]:
    """Replace the assistant turns of one conversation by the target's replies.

    Returns ``(messages, tokens_generated, note)``. ``messages`` is None when nothing could be generated (``note``
    says why: no user turn, prompt longer than the context, empty reply). In ``"first"`` mode the conversation ends
    after the first reply; in ``"all"`` mode every assistant turn is regenerated with the earlier regenerated replies
    in context, a trailing user turn gets a reply too, and ``note == "truncated"`` when the context filled up.
    A first prompt that does not fit in ``context`` is skipped before any model work; ``log`` then gets one line
    naming ``what``, its token count and the limit.
    """
    if turns not in TURNS:
        raise ValueError(f"turns must be one of {TURNS}, got {turns!r}")
    # reply slots: assistant turns preceded by a user turn; a conversation ending in a user turn gets one more
    slots = [i for i, m in enumerate(messages)
             if m["role"] == "assistant" and any(p["role"] == "user" for p in messages[:i])]
    if messages and messages[-1]["role"] == "user":
        slots.append(len(messages))
    slots = slots[:1] if turns == "first" else slots
    if not slots:
        return None, 0, "no user turn"
    out: list[dict] = []
    total, done, cursor = 0, 0, 0
    for slot in slots:
        # the original replies are dropped: only system/user turns are carried over (leading assistant turns too)
        context_msgs = out + [m for m in messages[cursor:slot] if m["role"] != "assistant"]
        prompt = render_prompt(tokenizer, context_msgs)
        room = max_new_tokens if context is None else min(max_new_tokens, context - len(prompt))
        if room <= 0:
            if done == 0:
                try:
                    check_prompt_fits(len(prompt), context, what)
                except ValueError as err:
                    if log is not None:
                        log(f"{err}; skipped")
                return None, total, "prompt longer than the context"
            return out, total, "truncated"
        tokens = generate_ar(model, prompt, room, temperature=temperature, top_p=top_p, eos_ids=eos_ids,
                             generator=generator)
        total += len(tokens)
        out = context_msgs + [{"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=True)
                               .strip()}]
        cursor, done = slot + 1, done + 1
    if not any(m["role"] == "assistant" and m["content"] for m in out):
        return None, total, "empty reply"
    return out, total, None


def _read_partial(partial: Path) -> tuple[int, int]:
    """Keep the complete lines of an interrupted run: returns ``(lines, last source_index)``; cuts a torn tail."""
    data = partial.read_bytes()
    good, lines, last = 0, 0, -1
    for raw in data.splitlines(keepends=True):
        try:
            if not raw.endswith(b"\n"):
                raise ValueError
            last = int(json.loads(raw)["source_index"])
        except (ValueError, KeyError, TypeError):
            if good + len(raw) < len(data):  # a bad line in the middle is corruption, not an interruption
                raise ValueError(f"{partial} has a corrupt line after {lines} good ones; "
                                 "delete it to start over") from None
            break
        good, lines = good + len(raw), lines + 1
    if good < len(data):
        with open(partial, "r+b") as handle:
            handle.truncate(good)
    return lines, last


def regenerate(
    data: str, out: str | Path, target: str | None = None, limit: int | None = None, max_new_tokens: int = 256,
    temperature: float = 0.0, top_p: float = 1.0, turns: str = "first", dtype: str = "bf16", seed: int = 0,
    kernels: str = "auto", log: Callable[[str], None] | None = None,
) -> RegenerateReport:
    """Regenerate ``data`` with the target and write ``out`` (jsonl), resuming an interrupted ``out.partial``."""
    from draftsmith.runtime.serving import load_runtime

    _check_arguments(turns, max_new_tokens, limit)
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    out = Path(out)
    partial, meta_path = Path(f"{out}.partial"), Path(f"{out}.partial.json")
    report = RegenerateReport()
    conversations = iter_conversations(data, report)
    first = next(conversations, None)  # fail on empty data before the (slow) model load
    if first is None:
        raise ValueError(f"no conversations in {data}: expected records with 'conversations' or 'messages'")
    settings = {"data": data, "target": target, "max_new_tokens": max_new_tokens, "temperature": temperature,
                "top_p": top_p, "turns": turns, "dtype": dtype, "seed": seed}
    last_done = _resume_or_start(out, partial, meta_path, settings, report, log)
    # The ETA needs the total: one counting pass over the data (up to the limit), seconds against hours.
    total = sum(1 for _ in itertools.islice(iter_conversations(data), limit))
    rt = load_runtime(None, target, dtype, kernels)
    eos = stop_ids(rt.tokenizer, rt.eos_ids)
    context = context_limit(rt.model)
    seen, start, last_log = 0, time.perf_counter(), 0.0
    resumed_before = None  # conversations the resumed file already held (the ETA counts this run's pace only)
    with open(partial, "a", encoding="utf-8") as handle:
        for index, messages in _chain(first, conversations):
            if limit is not None and seen >= limit:
                break
            seen += 1
            if index <= last_done:
                continue
            if resumed_before is None:
                resumed_before = seen - 1
            generator = torch.Generator().manual_seed(seed * 1_000_003 + index)  # per conversation: resumable
            new, tokens, note = regenerate_conversation(rt.model, rt.tokenizer, messages, turns, max_new_tokens,
                                                        temperature, top_p, eos, generator, context,
                                                        f"conversation {index}", log)
            report.tokens += tokens
            if new is None:
                report.skip(note or "skipped")
                continue
            report.truncated += note == "truncated"
            _append_line(handle, {"messages": new, "source_index": index})
            report.written += 1
            now = time.perf_counter() - start
            if now - last_log >= 5.0 or report.written == 1:
                last_log = now
                _log_progress(log, report, seen, total, resumed_before, now)
    report.seconds = time.perf_counter() - start
    if report.written + report.resumed == 0:
        raise ValueError(f"no conversation of {data} could be regenerated (skipped: {report.skipped}); "
                         f"{partial} is left in place")
    os.replace(partial, out)  # atomic: OUT appears only complete
    meta_path.unlink(missing_ok=True)
    return report


def _check_arguments(turns: str, max_new_tokens: int, limit: int | None) -> None:
    """Refuse an unknown ``--turns`` mode and a non-positive ``--max-new-tokens`` or ``--limit``."""
    if turns not in TURNS:
        raise ValueError(f"--turns must be one of {', '.join(TURNS)}, got {turns!r}")
    if max_new_tokens < 1 or (limit is not None and limit < 1):
        raise ValueError("--max-new-tokens and --limit must be >= 1")


def _resume_or_start(out: Path, partial: Path, meta_path: Path, settings: dict[str, Any], report: RegenerateReport,
                     log: Callable[[str], None]) -> int:
    """Continue an interrupted ``partial`` written with the same ``settings`` (its complete lines counted in
    ``report.resumed``), or start a new one (its settings written to ``meta_path``); returns the last source index
    already done (-1 when starting)."""
    last_done = -1
    if partial.exists():
        saved = json.loads(meta_path.read_text()) if meta_path.is_file() else None
        if saved != settings:
            raise ValueError(f"{partial} was written with other settings ({saved}); rerun with those or delete "
                             f"{partial} and {meta_path} to start over")
        report.resumed, last_done = _read_partial(partial)
        log(f"resuming {partial}: {report.resumed} conversations already done (up to source index {last_done})")
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        meta_path.write_text(json.dumps(settings))
    return last_done


def _append_line(handle: Any, record: dict[str, Any]) -> None:
    """Append one JSON line and force it to disk (a crash keeps every complete line)."""
    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    handle.flush()
    os.fsync(handle.fileno())


def _log_progress(log: Callable[[str], None], report: RegenerateReport, seen: int, total: int, resumed_before: int,
                  now: float) -> None:
    """The progress line: conversations seen and written, tokens, pace and (this run's pace only) the ETA."""
    left = eta_seconds(seen - resumed_before, total - resumed_before, now)
    log(f"[{seen}/{total}] wrote {report.written + report.resumed}, "
        f"{report.tokens} tokens, {report.tokens / max(now, 1e-9):.1f} tokens/s"
        + (f", eta {format_duration(left)}" if left is not None else ""))


def _chain(first: tuple[int, list[dict]], rest: Iterator[tuple[int, list[dict]]]) -> Iterator[tuple[int, list[dict]]]:
    yield first
    yield from rest


def summary(report: RegenerateReport, out: str | Path) -> str:
    """The one-paragraph summary printed at the end of ``draftsmith regenerate``."""
    skipped = ", ".join(f"{n} {why}" for why, n in report.skipped.items()) or "none"
    return (f"wrote {out}: {report.written + report.resumed} conversations ({report.resumed} resumed, "
            f"{report.truncated} truncated at the context), skipped: {skipped}; generated {report.tokens} tokens "
            f"in {report.seconds:.1f} s ({report.tokens_per_s:.1f} tokens/s)")


__all__ = ["RegenerateReport", "iter_conversations", "normalize_messages", "regenerate", "regenerate_conversation",
           "render_prompt", "stop_ids", "summary"]
