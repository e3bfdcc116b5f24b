"""Chat data pipeline: normalising, loss masks, padding/bucketing/packing, DataModule cache."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_tiny_tokenizer

from draftsmith.common.errors import DataError
from draftsmith.distill.data import datamodule as data_mod
from draftsmith.distill.data.conversations import load_conversations, normalize_record
from draftsmith.distill.data.datamodule import ChatDataModule, load_samples, save_samples
from draftsmith.distill.data.samples import (
    TemplateError,
    bucket_by_length,
    collate,
    tokenize_conversation,
)

pytestmark = pytest.mark.unit

CONV = [
    {"role": "system", "content": "you are a hot python"},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "the answer is python ."},
    {"role": "user", "content": "explain why ?"},
    {"role": "assistant", "content": "it is I like code !"},
]


def _masked_runs(tokens: list, mask: list[int]) -> list[list]:
    """Contiguous runs of masked tokens."""
    runs, current = [], []
    for tok, m in zip(tokens, mask):
        if m:
            current.append(tok)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


# -------------------------------------------------------------------------- normalising and loading


def test_normalize_formats():
    want = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert (
        normalize_record(
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
        )
        == want
    )
    assert (
        normalize_record(
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
        )
        == want
    )
    assert normalize_record({"prompt": "q", "response": "a"}) == want
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "q"}]},
            {"role": "assistant", "content": "a"},
        ]
    }
    assert normalize_record(parts) == want
    assert normalize_record({"prompt": "q", "completion": "a", "system": "s"})[0] == {
        "role": "system",
        "content": "s",
    }
    with pytest.raises(ValueError, match="unknown role 'robot'"):
        normalize_record({"conversations": [{"from": "robot", "value": "x"}]})
    with pytest.raises(ValueError, match="unknown record structure"):
        normalize_record({"text": "x"})


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


RECORDS = [
    {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"}]},
    {"messages": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]},
    {"prompt": "q3", "response": "a3"},
    {"conversations": [{"from": "human", "value": "only a question"}]},
]


def test_load_jsonl_drops_no_assistant(tmp_path):
    convs, report = load_conversations(str(_write_jsonl(tmp_path / "d.jsonl", RECORDS)))
    assert [c[-1]["content"] for c in convs] == ["a1", "a2", "a3"]
    assert (report.kept, report.skipped, report.turns) == (3, 1, 6)
    assert "without an assistant turn" in report.reason
    convs, report = load_conversations(str(tmp_path / "d.jsonl"), limit=2)
    assert len(convs) == 2


def test_load_truncated_json_array(tmp_path):
    text = json.dumps(RECORDS[:3] + [RECORDS[0]])
    (tmp_path / "d.json").write_text(text[:-10])
    convs, report = load_conversations(str(tmp_path / "d.json"))
    assert len(convs) == 3 and report.skipped == 1 and "truncated" in report.reason


def test_load_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": f"a{i}"},
            ]
        }
        for i in range(5)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    convs, report = load_conversations(str(tmp_path / "d.parquet"))
    assert report.kept == 5 and convs[4] == rows[4]["messages"]


def test_load_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(RECORDS[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        load_conversations(str(bad))
    odd = _write_jsonl(tmp_path / "odd.jsonl", [RECORDS[0], {"text": "plain"}])
    with pytest.raises(ValueError, match=r"odd\.jsonl:2: unknown record structure"):
        load_conversations(str(odd))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_conversations(str(tmp_path / "missing.jsonl"))


# ----------------------------------------------------------------------------- loss mask


def test_mask_covers_exactly_assistant_tokens(tiny_tokenizer):
    out = tokenize_conversation(tiny_tokenizer, CONV, 256)
    tokens = tiny_tokenizer.convert_ids_to_tokens(out["input_ids"])
    assert len(out["loss_mask"]) == len(tokens)
    assert _masked_runs(tokens, out["loss_mask"]) == [
        ["the", "answer", "is", "python", ".", "<|im_end|>"],
        ["it", "is", "I", "like", "code", "!", "<|im_end|>"],
    ]
    assert (
        out["input_ids"]
        == tiny_tokenizer(
            tiny_tokenizer.apply_chat_template(CONV, tokenize=False), add_special_tokens=False
        )["input_ids"]
    )


def test_mask_leading_assistant_and_truncation(tiny_tokenizer):
    out = tokenize_conversation(tiny_tokenizer, CONV[2:], 256)
    tokens = tiny_tokenizer.convert_ids_to_tokens(out["input_ids"])
    assert _masked_runs(tokens, out["loss_mask"])[0] == [
        "the",
        "answer",
        "is",
        "python",
        ".",
        "<|im_end|>",
    ]
    full = tokenize_conversation(tiny_tokenizer, CONV, 256)
    cut = tokenize_conversation(tiny_tokenizer, CONV, 17)
    assert cut["input_ids"] == full["input_ids"][:17] and cut["loss_mask"] == full["loss_mask"][:17]


def test_unsupported_templates_raise():
    tok = build_tiny_tokenizer()
    tok.chat_template = (  # no roles, no generation prompt
        "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    )
    with pytest.raises(TemplateError, match="unsupported"):
        tokenize_conversation(tok, CONV, 64)
    tok.chat_template = (
        "{{ messages[-1]['content'] }}{% if add_generation_prompt %}<|im_start|>assistant\n{%"
        " endif %}"
    )
    with pytest.raises(TemplateError, match="earlier turns"):
        tokenize_conversation(tok, CONV, 64)


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from transformers import AutoTokenizer

    from draftsmith.assets import default_target_dir

    return AutoTokenizer.from_pretrained(default_target_dir())


@pytest.mark.integration
def test_mask_with_real_smollm2_template(smollm_tokenizer):
    tok = smollm_tokenizer
    conv = [
        {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken\ncross the road?"},
    ]
    for messages in (
        conv,
        conv[1:],
    ):  # the second starts with an assistant turn (common in ShareGPT)
        out = tokenize_conversation(tok, messages, 512)
        runs = [tok.decode(r) for r in _masked_runs(out["input_ids"], out["loss_mask"])]
        assert runs == [
            "Hello! How can I help?<|im_end|>",
            "Why did the chicken\ncross the road?<|im_end|>",
        ]
        assert (
            out["input_ids"]
            == tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)[
                "input_ids"
            ]
        )


# ----------------------------------------------------------------------------- batching


def _samples(lengths):
    return [
        {"input_ids": list(range(1, n + 1)), "loss_mask": [i % 2 for i in range(n)]}
        for n in lengths
    ]


def test_collate_right_pads():
    batch = collate(_samples([3, 5, 1]), pad_id=0)
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        k: (3, 5) for k in ("input_ids", "attention_mask", "loss_mask")
    }
    assert all(v.dtype == torch.long for v in batch.values())
    assert batch["input_ids"][0].tolist() == [1, 2, 3, 0, 0]
    assert batch["attention_mask"].sum(1).tolist() == [3, 5, 1]
    assert batch["loss_mask"][1].tolist() == [0, 1, 0, 1, 0]


def test_bucket_by_length():
    lengths = [
        int(x) for x in torch.randint(1, 500, (203,), generator=torch.Generator().manual_seed(0))
    ]
    batches = bucket_by_length(lengths, batch_size=8, seed=3, window=4)
    assert sorted(i for b in batches for i in b) == list(range(203))
    assert sum(len(b) < 8 for b in batches) <= -(-203 // 32)  # at most one short batch per window
    assert batches == bucket_by_length(lengths, batch_size=8, seed=3, window=4)
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches)
    rand = [list(range(i, min(i + 8, 203))) for i in range(0, 203, 8)]
    assert spread < sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in rand) / 2


def test_save_load_samples_roundtrip(tmp_path):
    samples = _samples([3, 1, 4])
    save_samples(tmp_path / "s.safetensors", samples, {"x": 1})
    loaded, meta = load_samples(tmp_path / "s.safetensors")
    assert meta == {"x": 1} and len(loaded) == 3
    assert all(
        a["input_ids"].tolist() == b["input_ids"] and a["loss_mask"].tolist() == b["loss_mask"]
        for a, b in zip(loaded, samples)
    )


def _convs(n: int) -> list[dict]:
    return [
        {
            "conversations": [
                {"from": "human", "value": "hello world " * (1 + i % 4)},
                {"from": "gpt", "value": "the answer is python ." * (1 + i % 3)},
            ]
        }
        for i in range(n)
    ]


def test_datamodule_split_batches_and_cache(tiny_tokenizer, tmp_path, monkeypatch):
    spec = str(_write_jsonl(tmp_path / "chat.jsonl", _convs(50)))
    dm = ChatDataModule(
        tiny_tokenizer,
        spec,
        max_length=24,
        batch_size=4,
        val_fraction=0.1,
        seed=1,
        cache_dir=tmp_path / "cache",
    )
    dm.prepare_data()
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (45, 5)
    assert dm.cache_path.is_file() and dm.cache_path.suffix == ".safetensors"
    batches = list(dm.train_dataloader())
    assert sum(b["input_ids"].shape[0] for b in batches) == 45
    for b in batches:
        assert b["input_ids"].shape == b["loss_mask"].shape == b["attention_mask"].shape
        assert b["input_ids"].shape[1] <= 24 and b["loss_mask"].sum() > 0
        assert (b["loss_mask"] <= b["attention_mask"]).all()
    assert sum(b["input_ids"].shape[0] for b in dm.val_dataloader()) == 5

    def no_reload(*args, **kwargs):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(data_mod, "load_conversations", no_reload)
    again = ChatDataModule(
        tiny_tokenizer,
        spec,
        max_length=24,
        batch_size=4,
        val_fraction=0.1,
        seed=1,
        cache_dir=tmp_path / "cache",
        packing=True,
    )
    again.setup("fit")
    for a, b in zip(
        again.train_set.samples + again.val_set.samples, dm.train_set.samples + dm.val_set.samples
    ):
        assert np.array_equal(a["input_ids"], b["input_ids"]) and np.array_equal(
            a["loss_mask"], b["loss_mask"]
        )
    packed = list(again.train_dataloader())
    assert all(b["input_ids"].shape[1] <= 24 for b in packed)
    assert sum(int(b["attention_mask"].sum()) for b in packed) == sum(dm.train_set.lengths)
    other = ChatDataModule(
        tiny_tokenizer, spec, max_length=32, batch_size=4, cache_dir=tmp_path / "cache"
    )
    assert other.cache_path != dm.cache_path
    # the same data at another path (a test's fresh tmp file, a copy) shares the entry; edited data
    # does not
    copy = tmp_path / "elsewhere" / "copy.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(Path(spec).read_bytes())
    assert (
        _module(tiny_tokenizer, copy, tmp_path).cache_path
        == _module(tiny_tokenizer, spec, tmp_path).cache_path
    )
    copy.write_bytes(copy.read_bytes().replace(b"hello", b"hallo", 1))  # same size, other content
    assert (
        _module(tiny_tokenizer, copy, tmp_path).cache_path
        != _module(tiny_tokenizer, spec, tmp_path).cache_path
    )


def _module(tokenizer, spec, tmp_path: Path) -> ChatDataModule:
    return ChatDataModule(
        tokenizer, str(spec), max_length=24, batch_size=4, cache_dir=tmp_path / "cache"
    )


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty"])
def test_a_damaged_tokenised_cache_is_said_and_rebuilt(damage, tiny_tokenizer, tmp_path, caplog):
    spec = str(_write_jsonl(tmp_path / "chat.jsonl", _convs(20)))
    first = _module(tiny_tokenizer, spec, tmp_path)
    want = [s["input_ids"].tolist() for s in first.samples()]
    path, data = first.cache_path, bytearray(first.cache_path.read_bytes())
    if damage == "truncated":  # a copy or a write that stopped
        path.write_bytes(bytes(data[: len(data) - 40]))
    elif damage == "flipped":  # one byte of the token ids changed on disk
        data[-30] ^= 0x01
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(b"")
    with caplog.at_level("WARNING"):
        again = _module(
            tiny_tokenizer, spec, tmp_path
        ).samples()  # used to raise the same error on every re-run
    assert [s["input_ids"].tolist() for s in again] == want
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and f"the tokenised-data cache {path} is damaged (" in warned[0], warned
    assert "tokenising the data again" in warned[0]
    assert (
        load_samples(path)[0] and len(list(path.parent.iterdir())) == 1
    )  # rebuilt whole, no temporary


def test_a_full_disk_while_caching_leaves_no_file_and_goes_on(
    tiny_tokenizer, tmp_path, monkeypatch, caplog
):
    import safetensors.numpy

    def disk_fills(arrays, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 64)  # part of the file, then the disk is full
        raise safetensors.SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(safetensors.numpy, "save_file", disk_fills)
    spec = str(_write_jsonl(tmp_path / "chat.jsonl", _convs(20)))
    module = _module(tiny_tokenizer, spec, tmp_path)
    with caplog.at_level("WARNING"):
        samples = module.samples()
    assert len(samples) == 20 and isinstance(samples[0]["input_ids"], np.ndarray)
    assert list((tmp_path / "cache").iterdir()) == []  # no half-written cache, no temporary
    assert (
        "no space left on the device for" in caplog.text
        and "training goes on without the cache" in caplog.text
    )


def test_a_data_folder_of_mixed_files_reads_every_chat_file_and_names_the_rest(tmp_path, caplog):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "mixed"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", _convs(6))
    rows = _convs(10)[6:]
    pq.write_table(pa.Table.from_pylist(rows), folder / "b.parquet")
    (folder / "junk.bin").write_bytes(bytes(range(256)))
    (folder / "notes.txt").write_text("not data")
    with caplog.at_level("WARNING"):
        conversations, report = load_conversations(str(folder))
    assert (
        len(conversations) == 10 and report.kept == 10
    )  # `datasets` read the parquet alone: 4 of 10, silently
    assert (
        "skipping 2 file(s) that are not .jsonl/.json/.parquet: junk.bin, notes.txt" in caplog.text
    )
    alien = {"conversations": [{"from": "alien", "value": "x"}]}
    pq.write_table(pa.Table.from_pylist([*rows, alien]), folder / "b.parquet")
    with pytest.raises(DataError, match=r"b\.parquet:5: message 0 has unknown role 'alien'"):
        load_conversations(str(folder))


def test_a_utf8_bom_is_read_and_utf16_is_named(tmp_path):
    rows = "\n".join(json.dumps(c) for c in _convs(3)) + "\n"
    (tmp_path / "bom.jsonl").write_bytes(
        b"\xef\xbb\xbf" + rows.encode()
    )  # as Windows editors save it
    assert len(load_conversations(str(tmp_path / "bom.jsonl"))[0]) == 3
    (tmp_path / "u16.jsonl").write_bytes(rows.encode("utf-16"))
    with pytest.raises(DataError, match=r"u16\.jsonl is UTF-16 text: save it as UTF-8"):
        load_conversations(str(tmp_path / "u16.jsonl"))
