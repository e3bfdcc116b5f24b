"""``draftsmith regenerate``: self-distilled replies through the runtime, resumable jsonl, clear
errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from draftsmith.bench.timing import eos_ids_from_folder
from draftsmith.datagen import conversation_replies as replies
from draftsmith.datagen import regenerate as regen
from draftsmith.distill.data.conversations import load_conversations
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.target.loading import load_decoder

pytestmark = pytest.mark.unit

SMALL = dict(max_new_tokens=6, dtype="fp32")


def _write(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _reference(folder: Path, messages: list[dict], max_new_tokens: int) -> str:
    """The reply generate_ar gives on the same rendered prompt (greedy, fp32)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = load_decoder(folder, dtype=torch.float32)
    eos = replies.stop_ids(tokenizer, eos_ids_from_folder(folder))
    tokens = generate_ar(
        model, replies.render_prompt(tokenizer, messages), max_new_tokens, eos_ids=eos
    )
    return tokenizer.decode(tokens, skip_special_tokens=True).strip()


def test_first_turn_greedy_equals_generate_ar_and_output_loads(
    tiny_target_dir, tiny_data_file, tmp_path
):
    out = tmp_path / "regen.jsonl"
    report = regen.regenerate(
        str(tiny_data_file), out, target=str(tiny_target_dir), limit=3, **SMALL
    )
    assert report.written == 3 and report.tokens > 0
    assert not Path(f"{out}.partial").exists() and not Path(f"{out}.partial.json").exists()
    conversations, read = load_conversations(str(out))
    assert read.kept == 3 and read.skipped == 0
    originals = [json.loads(line) for line in tiny_data_file.read_text().splitlines()[:3]]
    for i, (line, conv, orig) in enumerate(
        zip(out.read_text().splitlines(), conversations, originals)
    ):
        assert json.loads(line)["source_index"] == i
        user = {"role": "user", "content": orig["conversations"][0]["value"]}
        assert conv[0] == user and conv[1]["role"] == "assistant" and len(conv) == 2
        assert conv[1]["content"] == _reference(tiny_target_dir, [user], 6)
        assert conv[1]["content"] != orig["conversations"][1]["value"]  # really rewritten


def test_all_turns_use_own_previous_replies(tiny_target_dir, tmp_path):
    data = _write(
        tmp_path / "multi.jsonl",
        [
            {
                "messages": [
                    {"role": "system", "content": "you are hello"},
                    {"role": "user", "content": "why is water hot"},
                    {"role": "assistant", "content": "original one"},
                    {"role": "user", "content": "explain more"},
                    {"role": "assistant", "content": "original two"},
                    {"role": "user", "content": "and then"},
                ]
            },
        ],
    )
    out = tmp_path / "all.jsonl"
    regen.regenerate(str(data), out, target=str(tiny_target_dir), turns="all", **SMALL)
    msgs = json.loads(out.read_text())["messages"]
    assert [m["role"] for m in msgs] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    for k in (2, 4, 6):  # each reply conditioned on the regenerated history before it
        assert msgs[k]["content"] == _reference(tiny_target_dir, msgs[:k], 6)
    assert "original" not in json.dumps(msgs)


def test_resume_after_interruption_gives_identical_file(
    tiny_target_dir, tiny_data_file, tmp_path, monkeypatch
):
    kwargs = dict(target=str(tiny_target_dir), limit=5, temperature=0.9, top_p=0.9, seed=3, **SMALL)
    full = tmp_path / "full.jsonl"
    regen.regenerate(str(tiny_data_file), full, **kwargs)
    out = tmp_path / "resumed.jsonl"
    calls = {"n": 0}
    real = replies.generate_ar

    def interrupted(*args, **kw):
        calls["n"] += 1
        if calls["n"] > 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(replies, "generate_ar", interrupted)
    with pytest.raises(KeyboardInterrupt):
        regen.regenerate(str(tiny_data_file), out, **kwargs)
    monkeypatch.setattr(replies, "generate_ar", real)
    partial = Path(f"{out}.partial")
    assert not out.exists() and len(partial.read_text().splitlines()) == 2
    with open(partial, "a") as handle:  # a line torn by the crash
        handle.write('{"messages": [{"role": "user", "cont')
    logs: list[str] = []
    report = regen.regenerate(str(tiny_data_file), out, log=logs.append, **kwargs)
    assert report.resumed == 2 and report.written == 3 and "resuming" in logs[0]
    assert any(", eta " in m for m in logs)  # a long regeneration says how long is left
    assert out.read_bytes() == full.read_bytes()
    assert not partial.exists()


def test_resume_with_other_settings_is_refused(tiny_target_dir, tiny_data_file, tmp_path):
    out = tmp_path / "o.jsonl"
    Path(f"{out}.partial").write_text("")
    Path(f"{out}.partial.json").write_text(json.dumps({"data": "x"}))
    with pytest.raises(ValueError, match="other settings"):
        regen.regenerate(str(tiny_data_file), out, target=str(tiny_target_dir), limit=1, **SMALL)


def test_prompt_longer_than_context_is_skipped_and_counted(tiny_target_dir, tmp_path):
    long_prompt = " ".join(["hello"] * 600)  # 600 word tokens > 512 positions of the tiny target
    data = _write(
        tmp_path / "long.jsonl",
        [
            {
                "conversations": [
                    {"from": "human", "value": long_prompt},
                    {"from": "gpt", "value": "x"},
                ]
            },
            {
                "conversations": [
                    {"from": "human", "value": "hello world"},
                    {"from": "gpt", "value": "x"},
                ]
            },
        ],
    )
    out = tmp_path / "long_out.jsonl"
    report = regen.regenerate(str(data), out, target=str(tiny_target_dir), **SMALL)
    assert report.written == 1 and report.skipped == {"prompt longer than the context": 1}
    assert json.loads(out.read_text())["source_index"] == 1
    assert "1 prompt longer than the context" in regen.summary(report, out)


def test_errors(tiny_target_dir, tmp_path, capsys):
    from draftsmith.cli import main

    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist"):
        regen.regenerate(str(missing), tmp_path / "o.jsonl", target=str(tiny_target_dir))
    assert main(["regenerate", "--data", str(missing), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    empty = _write(tmp_path / "empty.jsonl", [])
    with pytest.raises(ValueError, match="no conversations"):
        regen.regenerate(str(empty), tmp_path / "o.jsonl", target=str(tiny_target_dir))
    bad = _write(
        tmp_path / "bad.jsonl",
        [{"messages": [{"role": "user", "content": "hi"}]}, {"text": "no chat"}],
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a 'conversations'"):
        regen.regenerate(str(bad), tmp_path / "o.jsonl", target=str(tiny_target_dir), **SMALL)
    with pytest.raises(ValueError, match="--turns must be one of"):
        regen.regenerate(str(bad), tmp_path / "o.jsonl", turns="last")


def test_without_a_limit_the_progress_counts_the_whole_file_and_gives_an_eta(
    tiny_target_dir, tiny_data_file, tmp_path
):
    logs: list[str] = []
    report = regen.regenerate(
        str(tiny_data_file),
        tmp_path / "all.jsonl",
        target=str(tiny_target_dir),
        log=logs.append,
        **SMALL,
    )
    records = len(tiny_data_file.read_text().splitlines())
    progress = [m for m in logs if m.startswith("[")]
    assert (
        report.written >= 1
        and progress
        and progress[0].startswith(f"[1/{records}]")
        and ", eta " in progress[0]
    )
    logs.clear()  # a limit beyond the file counts the file, not the limit
    regen.regenerate(
        str(tiny_data_file),
        tmp_path / "over.jsonl",
        target=str(tiny_target_dir),
        limit=10 * records,
        log=logs.append,
        **SMALL,
    )
    assert [m for m in logs if m.startswith("[")][0].startswith(f"[1/{records}]")


def test_topic_and_skip_select_the_conversations_regenerated(tiny_target_dir, tmp_path):
    """--topic code keeps conversations whose first user message asks for code, --skip starts at a
    source index; the output's source_index points back at the records kept, and a topic nothing
    matches is a clear error.
    """
    chat = [
        ("Tell me about Paris.", "It is a city."),
        ("Write a python function that adds two numbers.", "ok"),
        ("What is love?", "A feeling."),
        ("Fix this: ```x = 1 +```", "x = 1"),
        ("Explain the SQL JOIN clause.", "It joins."),
    ]
    data = _write(
        tmp_path / "mixed.jsonl",
        [
            {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in chat
        ],
    )
    out = tmp_path / "code.jsonl"
    report = regen.regenerate(
        str(data), out, target=str(tiny_target_dir), topic="code", skip=2, **SMALL
    )
    assert report.written == 2
    assert [json.loads(line)["source_index"] for line in out.read_text().splitlines()] == [3, 4]
    out_all = tmp_path / "all.jsonl"
    regen.regenerate(str(data), out_all, target=str(tiny_target_dir), topic="code", **SMALL)
    assert [json.loads(line)["source_index"] for line in out_all.read_text().splitlines()] == [
        1,
        3,
        4,
    ]
    with pytest.raises(
        ValueError, match="no conversations in .* on topic 'code' from source index 5 on"
    ):
        regen.regenerate(
            str(data), tmp_path / "none.jsonl", target=str(tiny_target_dir), topic="code", skip=5
        )
    with pytest.raises(ValueError, match="unknown topic 'poetry'; choose one of all, code"):
        regen.regenerate(
            str(data), tmp_path / "none.jsonl", target=str(tiny_target_dir), topic="poetry"
        )


def _short_and_long_prompts(folder: Path, tmp_path: Path) -> tuple[Path, int, int]:
    """Five conversations, the 2nd and 4th with long first prompts; returns (data file, a
    --max-prompt-tokens cut between the short and the long prompts, the number of records)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    questions = [
        "hello world",
        " ".join(["hello"] * 40),
        "good day",
        " ".join(["world"] * 30),
        "hi there",
    ]
    data = _write(
        tmp_path / "mixed.jsonl",
        [
            {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "x"}]}
            for q in questions
        ],
    )
    lengths = [
        len(replies.render_prompt(tokenizer, [{"role": "user", "content": q}])) for q in questions
    ]
    cut = max(lengths[0], lengths[2], lengths[4])
    # the two long questions are over the cut, the three short ones not
    assert cut < min(lengths[1], lengths[3])
    return data, cut, len(questions)


def _interrupted_run(out: Path, data: Path, folder: Path, max_prompt_tokens: int) -> None:
    """An empty partial output and the settings file of a run (SMALL settings) interrupted there."""
    Path(f"{out}.partial").write_text("")
    Path(f"{out}.partial.json").write_text(
        json.dumps(
            {
                "data": str(data),
                "target": str(folder),
                "max_new_tokens": 6,
                "temperature": 0.0,
                "top_p": 1.0,
                "turns": "first",
                "dtype": "fp32",
                "seed": 0,
                "batch_size": regen.DEFAULT_BATCH_SIZE,
                "max_prompt_tokens": max_prompt_tokens,
            }
        )
    )


def test_max_prompt_tokens_keeps_short_prompts_counts_the_rest_and_the_limit_counts_kept_ones(
    tiny_target_dir, tmp_path
):
    """--max-prompt-tokens skips a conversation whose first prompt is longer before any model work;
    --limit then counts the kept ones; a resume with another value is refused; a value below 1 is
    refused in one line.
    """
    data, cut, records = _short_and_long_prompts(tiny_target_dir, tmp_path)
    out = tmp_path / "short.jsonl"
    report = regen.regenerate(
        str(data), out, target=str(tiny_target_dir), max_prompt_tokens=cut, limit=2, **SMALL
    )
    assert [json.loads(line)["source_index"] for line in out.read_text().splitlines()] == [0, 2]
    # index 1, met before the limit's second keep
    assert report.skipped == {"prompt over --max-prompt-tokens": 1}
    assert "1 prompt over --max-prompt-tokens" in regen.summary(report, out)
    every = regen.regenerate(
        str(data), tmp_path / "every.jsonl", target=str(tiny_target_dir), **SMALL
    )
    assert every.written == records and not every.skipped
    with pytest.raises(ValueError, match="--max-prompt-tokens must be >= 1"):
        regen.regenerate(
            str(data), tmp_path / "bad.jsonl", target=str(tiny_target_dir), max_prompt_tokens=0
        )
    # an interrupted run (out itself is finished: a new run there is refused)
    other = tmp_path / "other.jsonl"
    _interrupted_run(other, data, tiny_target_dir, cut)
    with pytest.raises(ValueError, match="other settings"):
        regen.regenerate(
            str(data), other, target=str(tiny_target_dir), max_prompt_tokens=cut + 1, **SMALL
        )
