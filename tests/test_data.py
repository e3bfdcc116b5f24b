"""Chat data batching and its cache: padding, length buckets, packing, the DataModule's split and
its tokenised-data cache (shared by copies, rebuilt when damaged, skipped on a full disk). Reading
and tokenising: tests/test_data_loading.py, tests/test_data_tokenising.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from chat_files import varied_conversations, write_jsonl

from draftsmith.distill.data import datamodule as data_mod
from draftsmith.distill.data.datamodule import ChatDataModule, load_samples, save_samples
from draftsmith.distill.data.samples import bucket_by_length, collate

pytestmark = pytest.mark.unit


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


def _cached_module(tokenizer, spec: str, tmp_path: Path, **options) -> ChatDataModule:
    """A DataModule of ``spec`` (24 tokens, batches of 4, a tenth held out) set up for fitting
    with its cache in ``tmp_path / "cache"``."""
    dm = ChatDataModule(
        tokenizer,
        spec,
        max_length=24,
        batch_size=4,
        val_fraction=0.1,
        seed=1,
        cache_dir=tmp_path / "cache",
        **options,
    )
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_datamodule_split_batches_and_cache(tiny_tokenizer, tmp_path):
    spec = str(write_jsonl(tmp_path / "chat.jsonl", varied_conversations(50)))
    dm = _cached_module(tiny_tokenizer, spec, tmp_path)
    assert (len(dm.train_set), len(dm.val_set)) == (45, 5)
    assert dm.cache_path.is_file() and dm.cache_path.suffix == ".safetensors"
    batches = list(dm.train_dataloader())
    assert sum(b["input_ids"].shape[0] for b in batches) == 45
    for b in batches:
        assert b["input_ids"].shape == b["loss_mask"].shape == b["attention_mask"].shape
        assert b["input_ids"].shape[1] <= 24 and b["loss_mask"].sum() > 0
        assert (b["loss_mask"] <= b["attention_mask"]).all()
    assert sum(b["input_ids"].shape[0] for b in dm.val_dataloader()) == 5


def test_a_second_datamodule_reads_the_cache_and_packs_it(tiny_tokenizer, tmp_path, monkeypatch):
    spec = str(write_jsonl(tmp_path / "chat.jsonl", varied_conversations(50)))
    dm = _cached_module(tiny_tokenizer, spec, tmp_path)

    def no_reload(*args, **kwargs):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(data_mod, "load_conversations", no_reload)
    again = _cached_module(tiny_tokenizer, spec, tmp_path, packing=True)
    for a, b in zip(
        again.train_set.samples + again.val_set.samples, dm.train_set.samples + dm.val_set.samples
    ):
        assert np.array_equal(a["input_ids"], b["input_ids"]) and np.array_equal(
            a["loss_mask"], b["loss_mask"]
        )
    packed = list(again.train_dataloader())
    assert all(b["input_ids"].shape[1] <= 24 for b in packed)
    assert sum(int(b["attention_mask"].sum()) for b in packed) == sum(dm.train_set.lengths)


def test_the_cache_entry_follows_the_data_and_the_length_not_the_path(tiny_tokenizer, tmp_path):
    spec = str(write_jsonl(tmp_path / "chat.jsonl", varied_conversations(50)))
    dm = _cached_module(tiny_tokenizer, spec, tmp_path)
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
    spec = str(write_jsonl(tmp_path / "chat.jsonl", varied_conversations(20)))
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
    # rebuilt whole, no temporary
    assert load_samples(path)[0] and len(list(path.parent.iterdir())) == 1


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
    spec = str(write_jsonl(tmp_path / "chat.jsonl", varied_conversations(20)))
    module = _module(tiny_tokenizer, spec, tmp_path)
    with caplog.at_level("WARNING"):
        samples = module.samples()
    assert len(samples) == 20 and isinstance(samples[0]["input_ids"], np.ndarray)
    assert list((tmp_path / "cache").iterdir()) == []  # no half-written cache, no temporary
    assert (
        "no space left on the device for" in caplog.text
        and "training goes on without the cache" in caplog.text
    )
