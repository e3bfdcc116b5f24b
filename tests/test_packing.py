"""Token-budget batches: bin-packed fixed rows with document ids and restarting positions; the
target and the EAGLE-3 loss see each packed conversation exactly as they see it alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import build_tiny_llama
from eagle3_objectives import make_objective

from draftsmith.distill.data.datamodule import ChatDataModule, rows_per_step
from draftsmith.distill.data.packing import (
    best_fit_decreasing,
    collate_packed,
    pack_rows,
    packing_report,
    row_batches,
)
from draftsmith.distill.data.samples import collate
from draftsmith.distill.losses.ttt import eagle3_ttt_loss
from draftsmith.distill.target.frozen import Target

pytestmark = pytest.mark.unit


def samples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "input_ids": rng.integers(5, 60, n).tolist(),
            "loss_mask": (rng.random(n) > 0.3).astype(int).tolist(),
        }
        for n in lengths
    ]


def test_best_fit_decreasing_fills_the_fullest_bin_that_fits():
    lengths = np.asarray([6, 5, 4, 3, 2])
    assert best_fit_decreasing([0, 1, 2, 3, 4], lengths, 10) == [[0, 2], [1, 3, 4]]
    assert best_fit_decreasing([4, 3], lengths, 10) == [[3, 4]]


def test_pack_rows_keeps_every_token_once_pads_less_than_greedy_and_is_seeded():
    data = samples(np.random.default_rng(1).integers(3, 40, 300).tolist())
    rows = pack_rows(data, 64, seed=3)
    assert all(
        len(r["input_ids"]) <= 64 and sum(r["document_lengths"]) == len(r["input_ids"])
        for r in rows
    )
    packed_tokens = sorted(
        tuple(r["input_ids"][a : a + n])
        for r in rows
        for a, n in zip(np.cumsum([0, *r["document_lengths"][:-1]]), r["document_lengths"])
    )
    assert packed_tokens == sorted(tuple(s["input_ids"]) for s in data)
    greedy_rows, used = 1, 0  # consecutive greedy packing, what data.packing did before
    for s in data:
        if used + len(s["input_ids"]) > 64:
            greedy_rows, used = greedy_rows + 1, 0
        used += len(s["input_ids"])
    assert len(rows) < greedy_rows and packing_report(rows, 64)["padding"] < 0.05
    again = pack_rows(data, 64, seed=3)
    assert [r["input_ids"].tolist() for r in again] == [r["input_ids"].tolist() for r in rows]
    assert [r["input_ids"].tolist() for r in pack_rows(data, 64, seed=4)] != [
        r["input_ids"].tolist() for r in rows
    ]
    with pytest.raises(ValueError, match="row_length"):
        pack_rows(data, 1)


def test_collate_packed_writes_documents_positions_and_a_fixed_shape():
    rows = [
        {
            "input_ids": np.arange(1, 8),
            "loss_mask": np.ones(7, dtype=int),
            "document_lengths": [3, 4],
        },
        {"input_ids": np.arange(1, 4), "loss_mask": np.ones(3, dtype=int), "document_lengths": [3]},
    ]
    batch = collate_packed(rows, row_length=8, pad_id=0, rows_per_batch=3)
    assert {k: tuple(v.shape) for k, v in batch.items()} == {k: (3, 8) for k in batch}
    assert batch["document_ids"].tolist() == [
        [0, 0, 0, 1, 1, 1, 1, -1],
        [0, 0, 0, -1, -1, -1, -1, -1],
        [-1] * 8,
    ]
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 7]
    assert batch["attention_mask"].sum().item() == 10 and batch["input_ids"][2].tolist() == [0] * 8
    assert row_batches(5, 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="more than its length"):
        collate_packed(rows, row_length=6, pad_id=0)


@pytest.fixture()
def target(tiny_tokenizer) -> Target:
    return Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")


def packed_and_alone(lengths, vocab):
    docs = samples(lengths, seed=7)
    for d in docs:
        d["input_ids"] = [i % vocab for i in d["input_ids"]]
    row = {
        "input_ids": np.concatenate([d["input_ids"] for d in docs]),
        "loss_mask": np.concatenate([d["loss_mask"] for d in docs]),
        "document_lengths": list(lengths),
    }
    return docs, collate_packed([row], row_length=sum(lengths) + 3, pad_id=1)


def test_a_packed_document_gets_the_features_and_logits_it_gets_alone(target):
    from draftsmith.distill.target.features import FeatureTaps

    docs, packed = packed_and_alone([7, 9, 6], target.vocab_size)
    taps = FeatureTaps(final_hidden=True, layers=(1, 2, 3), logits=True)
    together = target.features(
        packed["input_ids"],
        packed["attention_mask"],
        taps,
        position_ids=packed["position_ids"],
        document_ids=packed["document_ids"],
    )
    start = 7  # document 2 (index 1) starts after the first document's 7 tokens
    ids = torch.tensor([docs[1]["input_ids"]])
    alone = target.features(ids, torch.ones_like(ids), taps)
    part = slice(start, start + 9)
    torch.testing.assert_close(together.logits[0, part], alone.logits[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(
        together.final_hidden[0, part], alone.final_hidden[0], rtol=0, atol=1e-5
    )
    for i in taps.layers:
        torch.testing.assert_close(
            together.layer_hidden[i][0, part], alone.layer_hidden[i][0], rtol=0, atol=1e-5
        )
    # without the document mask, document 2 would read document 1 (the check above can fail)
    crossed = target.features(packed["input_ids"], packed["attention_mask"], taps)
    assert (crossed.logits[0, part] - alone.logits[0]).abs().max() > 1e-3


def test_eagle3_loss_on_packed_rows_equals_the_loss_of_the_same_conversations_padded(target):
    objective = make_objective(target, draft_vocab=60, ttt_steps=3)
    for p in objective.module.parameters():
        p.data.normal_(0, 0.1)
    docs, packed = packed_and_alone([9, 11, 8], target.vocab_size)
    packed_feats = target.features(
        packed["input_ids"],
        packed["attention_mask"],
        objective.taps,
        position_ids=packed["position_ids"],
        document_ids=packed["document_ids"],
    )
    packed_loss = eagle3_ttt_loss(objective.module, objective.lm_loss, packed, packed_feats, 3, 0.8)
    padded = collate(docs, pad_id=1)
    padded_feats = target.features(padded["input_ids"], padded["attention_mask"], objective.taps)
    padded_loss = eagle3_ttt_loss(objective.module, objective.lm_loss, padded, padded_feats, 3, 0.8)
    assert float(padded_loss.scored) > 0
    torch.testing.assert_close(packed_loss.scored, padded_loss.scored)
    torch.testing.assert_close(packed_loss.total, padded_loss.total, rtol=0, atol=1e-5)
    for key, value in padded_loss.metrics.items():
        torch.testing.assert_close(packed_loss.metrics[key], value, rtol=0, atol=1e-5)


def test_tokens_per_step_batches_fixed_rows_in_tokens_with_workers_or_without(
    tiny_tokenizer, tmp_path
):
    convs = [
        {
            "conversations": [
                {"from": "human", "value": "hello world " * (1 + i % 5)},
                {"from": "gpt", "value": "the answer is python ." * (1 + i % 3)},
            ]
        }
        for i in range(60)
    ]
    spec = tmp_path / "chat.jsonl"
    spec.write_text("\n".join(json.dumps(c) for c in convs) + "\n")
    from omegaconf import OmegaConf

    assert rows_per_step(OmegaConf.create({"tokens_per_step": 100, "max_length": 32})) == 3
    assert rows_per_step(OmegaConf.create({"tokens_per_step": None, "max_length": 32})) is None

    def batches(workers: int) -> list[dict]:
        data = ChatDataModule(
            tiny_tokenizer,
            str(spec),
            max_length=32,
            batch_size=3,
            num_workers=workers,
            val_fraction=0.1,
            packing=True,
            seed=2,
            cache_dir=tmp_path / "cache",
        )
        data.setup("fit")
        return list(data.train_dataloader()), data

    plain, data = batches(0)
    assert all(
        b["input_ids"].shape == (3, 32) for b in plain
    )  # static, the last batch filled with empty rows
    assert sum(int(b["attention_mask"].sum()) for b in plain) == sum(data.train_set.lengths)
    assert all(set(b) >= {"document_ids", "position_ids"} for b in plain)
    with_workers, _ = batches(2)
    assert len(with_workers) == len(plain)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(plain, with_workers) for k in a)
