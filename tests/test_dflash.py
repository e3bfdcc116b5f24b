"""DFlash drafter and recipe: block alignment, non-causal blocks, training == serving forward, loss
goes down, export round trip, the heads, and every bad input of the recipe (runtime:
test_dflash_runtime.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_llama, train_on_fixed_batch
from recipe_configs import recipe_config

from draftsmith.common.errors import ConfigError
from draftsmith.distill.target.frozen import Target
from draftsmith.drafters.dflash import DFlashDrafter
from draftsmith.drafters.dflash_config import DFlashConfig, default_target_layers
from draftsmith.export.format import write_export
from draftsmith.recipes import get_recipe
from draftsmith.recipes.dflash import DFlash
from draftsmith.recipes.dflash.blocks import build_blocks, sample_anchors
from draftsmith.recipes.dflash.build import build_objective
from draftsmith.recipes.dflash.objective import DFlashObjective

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
LAYERS = (1, 2, 3)  # the tiny target has 4 layers
MASK = 1  # the tiny tokenizer's <pad>, never in the synthetic batches below (ids >= 5)


def recipe_cfg(data: dict | None = None, **drafter) -> DFlash:
    """The shipped recipe overlay with drafter overrides (tiny target taps, block of 4)."""
    return recipe_config(
        "dflash",
        {
            "drafter": {"target_layers": list(LAYERS), "block_size": 4, **drafter},
            "data": data or {},
        },
    )


@pytest.fixture()
def target(tiny_tokenizer) -> Target:
    return Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")


def batch_of(vocab: int, rows: int = 2, width: int = 20, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (rows, width), generator=g)
    ones = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": ones, "loss_mask": ones.clone()}


def make_objective(target: Target, batch: dict[str, torch.Tensor], **drafter) -> DFlashObjective:
    torch.manual_seed(0)
    return build_objective(
        recipe_cfg(**drafter), target, [(batch["input_ids"], batch["loss_mask"])]
    )


def tiny_drafter(vocab: int = 50, **config) -> DFlashDrafter:
    torch.manual_seed(0)
    cfg = DFlashConfig(
        **{
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "vocab_size": vocab,
            "target_hidden_size": 32,
            "block_size": 4,
            "mask_token_id": MASK,
            "target_layers": (1, 2),
            **config,
        }
    )
    return DFlashDrafter(cfg, torch.randn(vocab, 32), torch.randn(vocab, 32))


def test_default_taps_follow_zlab_plus_one():
    assert default_target_layers(30) == (
        2,
        15,
        28,
    )  # SmolLM2-135M; z-lab target_layer_ids (1, 14, 27)
    assert default_target_layers(36, 5) == (
        2,
        10,
        18,
        26,
        34,
    )  # z-lab's Qwen3-8B ids 1, 9, 17, 25, 33, plus one
    with pytest.raises(ValueError, match="no 3 distinct default DFlash taps"):
        default_target_layers(4)


def test_blocks_hand_built_alignment():
    """Anchor 3, block 4: slot 0 = x_3, mask slots at positions 4..6 predict tokens 4..6; context
    keys 0..2 only."""
    ids = torch.arange(10, 20)[None]  # [1, 10]
    ones = torch.ones_like(ids)
    labels = ones.clone()
    labels[0, 6] = 0  # token 6 is not a label: slot 3 (and any after it) unscored
    blocks = build_blocks(
        ids, labels, ones, torch.tensor([[3, 8]]), torch.tensor([[True, True]]), 4, MASK
    )
    assert blocks.block_ids.tolist() == [[13, MASK, MASK, MASK, 18, MASK, MASK, MASK]]
    assert blocks.positions.tolist() == [[3, 4, 5, 6, 8, 9, 10, 11]]
    assert blocks.label_pos[0, 0].tolist() == [4, 5, 6]
    assert blocks.scored.tolist() == [
        [[True, True, False], [True, False, False]]
    ]  # 10, 11 are past the sequence
    mask = blocks.mask[0, 0]  # [8, 10 + 8]
    assert mask[0, :10].tolist() == [True] * 3 + [False] * 7  # block at 3 sees context 0..2
    assert mask[5, :10].tolist() == [True] * 8 + [False] * 2
    # its own block, non-causal, never the other block
    assert mask[1, 10:].tolist() == [True] * 4 + [False] * 4


def test_anchor_sampling_picks_labelled_positions_only():
    labels = torch.zeros(2, 12, dtype=torch.long)
    labels[0, 6:] = 1
    anchors, valid = sample_anchors(
        labels, torch.ones(2, 12, dtype=torch.long), 3, torch.Generator().manual_seed(0)
    )
    assert valid[0].all() and not valid[1].any()  # row 1 has no labels: fillers only
    assert all(5 <= a <= 10 for a in anchors[0].tolist())  # first label a+1 in 6..11


def test_loss_scores_the_target_logits_at_a_plus_k_minus_1(target):
    """The teacher of slot k of the block anchored at a is the target's distribution at position
    a+k-1."""
    batch = batch_of(target.vocab_size, rows=1, width=12)
    objective = make_objective(target, batch, anchors_per_seq=1)
    feats = target.features(batch["input_ids"], batch["attention_mask"], objective.taps)
    seen = []

    def recording(hidden, weight, *, teacher_logits, topk):
        seen.append(teacher_logits.clone())
        return objective_lm_loss(hidden, weight, teacher_logits=teacher_logits, topk=topk)

    objective_lm_loss, objective.lm_loss = objective.lm_loss, recording
    objective.generator = torch.Generator().manual_seed(3)
    anchor = int(
        sample_anchors(
            batch["loss_mask"], batch["attention_mask"], 1, torch.Generator().manual_seed(3)
        )[0]
    )
    objective.loss(batch, feats)
    expect = [feats.logits[0, anchor + k - 1] for k in range(1, 4) if anchor + k < 12]
    assert len(seen) == len(expect) and all(torch.equal(s[0], e) for s, e in zip(seen, expect))


def test_block_is_non_causal_and_sees_only_earlier_context():
    d = tiny_drafter().eval()
    taps = torch.randn(1, 6, 64)
    ctx = d.context(taps, torch.arange(6)[None])
    pos = torch.arange(6, 10)[None]
    base = d.block_forward(torch.tensor([[7, MASK, MASK, MASK]]), pos, ctx)
    later = d.block_forward(
        torch.tensor([[7, MASK, MASK, 9]]), pos, ctx
    )  # change the LAST slot's input
    assert not torch.allclose(base[0, 1], later[0, 1])  # slot 1 sees slot 3: non-causal
    # Training blocks (several per sequence, masked) equal one serving block over its own context.
    ids = torch.randint(5, 50, (1, 12))
    ones = torch.ones_like(ids)
    blocks = build_blocks(
        ids, ones, ones, torch.tensor([[6, 2]]), torch.ones(1, 2, dtype=torch.bool), 4, MASK
    )
    taps = torch.randn(1, 12, 64)
    train_out = d.block_forward(
        blocks.block_ids, blocks.positions, d.context(taps, torch.arange(12)[None]), blocks.mask
    ).view(1, 2, 4, -1)
    for j, a in enumerate((6, 2)):
        alone = d.block_forward(
            blocks.block_ids[:, 4 * j : 4 * j + 4],
            blocks.positions[:, 4 * j : 4 * j + 4],
            d.context(taps[:, :a], torch.arange(a)[None]),
        )
        torch.testing.assert_close(train_out[0, j], alone[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "heads", [{}, {"confidence_head": True, "markov_head": True, "markov_rank": 8}]
)
def test_loss_goes_down_on_a_fixed_batch(target, heads):
    batch = batch_of(target.vocab_size)
    objective = make_objective(
        target, batch, anchors_per_seq=18, **heads
    )  # every candidate anchor: a fixed set
    feats = target.features(batch["input_ids"], batch["attention_mask"], objective.taps)
    # a peaked teacher (the random target is near uniform): CE can fall far
    feats.logits = feats.logits * 20
    losses = train_on_fixed_batch(objective, batch, feats, steps=15)
    assert losses[-1] < 0.9 * losses[0], losses
    _, metrics = objective.loss(batch, feats)
    assert metrics["slot1/top1"] > 0.3 and ("confidence_bce" in metrics) == bool(heads)


def test_initial_logits_are_not_overconfident(target):
    # Long LM-head rows (randn: |w_v| ~ 5.7, SmolLM2's ~3.2) made a gain-1 output norm start far
    # above ln V (CE ~20 on SmolLM2), which slowed early training; the default gain 1/mean|w_v|
    # starts at about ln V.
    vocab = 500
    d = tiny_drafter(vocab).eval()
    taps, root = torch.randn(4, 6, 64), torch.randint(5, vocab, (4,))
    labels = torch.randint(0, vocab, (4 * 3,), generator=torch.Generator().manual_seed(0))

    def initial_ce() -> float:
        logits = d.draft_greedy(taps, root)[1]  # [4, 3, V]
        return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels))

    assert initial_ce() < math.log(vocab) + 1.0
    with torch.no_grad():
        d.norm.weight.fill_(1.0)  # the old init
    assert initial_ce() > math.log(vocab) + 5.0
    batch = batch_of(target.vocab_size)
    assert torch.all(make_objective(target, batch, output_norm_init=1.0).module.norm.weight == 1.0)


def test_markov_head_starts_neutral_and_conditions_on_the_previous_token():
    d = tiny_drafter(markov_head=True, markov_rank=4).eval()
    hidden = torch.randn(3, 32)
    prev = torch.tensor([5, 6, 7])
    torch.testing.assert_close(d.head_input(hidden, prev), d.norm(hidden))  # up starts at zero
    with torch.no_grad():
        d.markov_head.up.weight.normal_()
    assert not torch.allclose(d.head_input(hidden, prev), d.head_input(hidden, prev.flip(0)))
    with pytest.raises(ValueError, match="Markov head"):
        d.head_input(hidden)


def test_export_round_trip_is_exact(tmp_path):
    d = tiny_drafter(confidence_head=True, markov_head=True, markov_rank=4).eval()
    config = {
        "method": "dflash",
        "architecture": d.architecture(),
        "target": {"name_or_path": "tiny"},
    }
    out = write_export(tmp_path / "export", d.state_dict(), config)
    back, _ = DFlashDrafter.from_export(
        out, embed_weight=d.embed_weight, lm_head_weight=d.lm_head_weight
    )
    assert set(back.state_dict()) == set(d.state_dict()) and "embed_weight" not in back.state_dict()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in d.state_dict().items())
    taps, root = torch.randn(2, 5, 64), torch.tensor([8, 9])
    assert torch.equal(back.draft_greedy(taps, root)[1], d.draft_greedy(taps, root)[1])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"block_size": 1}, "block_size=1 is out of range: allowed >= 2"),
        ({"block_size": 48}, "block_size=48 is larger than the context: data.max_length=48"),
        ({"anchors_per_seq": 0}, "anchors_per_seq=0 is out of range: allowed >= 1"),
        ({"position_decay": 0.0}, "position_decay=0.0 is out of range: allowed > 0 and <= 1"),
        ({"output_norm_init": 0.0}, "output_norm_init=0.0 is out of range: allowed > 0"),
        ({"target_layers": []}, r"target_layers=\[\] is out of range: allowed one or more indices"),
    ],
)
def test_validate_refuses_bad_config(bad, message):
    with pytest.raises(ConfigError, match=message):
        get_recipe("dflash").validate(recipe_cfg({"max_length": 48}, **bad))


def test_build_refuses_missing_taps_colliding_mask_and_oversized_block(target):
    batch = batch_of(target.vocab_size)
    with pytest.raises(
        ConfigError, match=r"names layer\(s\) \[4\] the target lacks: it has hidden_states 0..3"
    ):
        make_objective(target, batch, target_layers=[1, 4])
    collide = int(batch["input_ids"][0, 0])
    with pytest.raises(
        ConfigError, match=f"mask_token_id={collide} .* occurs .* in the training data"
    ):
        make_objective(target, batch, mask_token_id=collide)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        make_objective(target, batch, mask_token_id=target.vocab_size)
    with pytest.raises(ConfigError, match="larger than the target's context"):
        make_objective(target, batch, block_size=512)
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        tiny_drafter(block_size=1)


def test_default_mask_token_is_a_special_absent_from_the_data(target, tiny_tokenizer):
    batch = batch_of(target.vocab_size)
    assert make_objective(target, batch).module.config.mask_token_id == tiny_tokenizer.pad_token_id
    with_pad = {**batch, "input_ids": batch["input_ids"].clone()}
    with_pad["input_ids"][0, 0] = tiny_tokenizer.pad_token_id
    chosen = make_objective(target, with_pad).module.config.mask_token_id
    assert chosen == tiny_tokenizer.unk_token_id  # pad occurs in the data: the next candidate
