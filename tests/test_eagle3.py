"""EAGLE-3 drafter: draft vocabulary, default taps, TTT unrolling == step-by-step drafting, tree
expansion, export round trip and bad configs (its training: test_eagle3_training.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import build_tiny_llama
from eagle3_objectives import LAYERS, make_objective, recipe_cfg, vocab_batches
from transformers import LlamaConfig

from draftsmith.distill.engine.exporting import export_from_module
from draftsmith.distill.target.frozen import Target
from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Drafter, default_target_layers
from draftsmith.drafters.vocab import (
    count_assistant_tokens,
    draft_vocab_from_batches,
    select_draft_vocab,
    vocab_maps,
)
from draftsmith.export.format import read_export
from draftsmith.recipes import get_recipe
from draftsmith.recipes.eagle3 import objective as eagle3_recipe

pytestmark = pytest.mark.unit


@pytest.fixture()
def target(tiny_tokenizer) -> Target:
    return Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")


def test_vocab_selection_counts_assistant_tokens_and_builds_offset_maps():
    ids = torch.tensor([[5, 5, 5, 2, 9, 9, 1, 1, 1, 1]])
    mask = torch.tensor(
        [[1, 1, 1, 1, 1, 1, 0, 0, 0, 0]]
    )  # token 1 is frequent but never an assistant token
    counts = count_assistant_tokens([(ids, mask)], 12)
    assert counts.tolist() == [0, 0, 1, 0, 0, 3, 0, 0, 0, 2, 0, 0]
    assert select_draft_vocab(counts, 2).tolist() == [5, 9]
    assert select_draft_vocab(counts, 4).tolist() == [0, 2, 5, 9]  # unseen ids fill by lower id
    d2t, t2d = vocab_maps(torch.tensor([2, 5, 9]), 12)
    assert d2t.tolist() == [2, 4, 7]  # target = draft + d2t[draft]
    assert t2d.nonzero().flatten().tolist() == [2, 5, 9]
    d2t, t2d, stats = draft_vocab_from_batches([(ids, mask)], 12, 2)
    assert stats["coverage"] == pytest.approx(5 / 6) and stats["distinct"] == 3
    with pytest.raises(ValueError, match="no assistant tokens"):
        draft_vocab_from_batches([(ids, torch.zeros_like(mask))], 12, 2)
    with pytest.raises(ValueError, match="out of range"):
        count_assistant_tokens([(ids + 10, mask)], 12)
    with pytest.raises(ValueError, match="ascending"):
        vocab_maps(torch.tensor([5, 2]), 12)


def test_default_taps_and_architecture(target):
    cfg8 = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    assert Eagle3Config.from_hf_config(cfg8).target_layers == (2, 4, 5)
    assert default_target_layers(32) == (2, 16, 29)
    assert default_target_layers(4) == (1, 2, 3) and default_target_layers(3) == (
        0,
        1,
        2,
    )  # shallow: a spread
    with pytest.raises(ValueError, match="drafter.target_layers"):
        default_target_layers(2)
    drafter = make_objective(target).module
    h = target.hidden_size
    assert drafter.fc.weight.shape == (h, 3 * h) and drafter.fc.bias is None
    assert drafter.layer.self_attn.q_proj.weight.shape == (h, 2 * h)
    assert drafter.lm_head.weight.shape == (48, h)
    # The draft LM head starts from the target's rows of the draft vocabulary; 7 is in it.
    ids = drafter.draft_ids_in_target()
    assert torch.equal(drafter.lm_head.weight, target.lm_head_weight[ids]) and 7 in ids.tolist()
    assert torch.equal(drafter.draft_to_target(torch.arange(48)), ids)
    assert set(drafter.state_dict()) >= {"d2t", "t2d"} and not any(
        "embed" in k for k in drafter.state_dict()
    )


def test_ttt_unroll_equals_step_by_step_drafting(target):
    drafter = make_objective(target).module
    for p in drafter.parameters():
        p.data.normal_(0, 0.1)
    g = torch.Generator().manual_seed(3)
    B, N, steps, H = 2, 8, 3, target.hidden_size
    feats = torch.randn(B, N, 3 * H, generator=g)
    tokens = [torch.randint(0, target.vocab_size, (B, N), generator=g) for _ in range(steps)]
    with torch.no_grad():
        unrolled = [drafter.logits(a) for a in drafter.ttt_forward(feats, tokens)]
        for t in range(N):
            hidden, logits, cache = drafter.draft_step(
                drafter.fuse(feats[:, : t + 1]), tokens[0][:, : t + 1]
            )
            torch.testing.assert_close(logits[:, -1], unrolled[0][:, t], atol=1e-5, rtol=0)
            a = hidden[:, -1:]
            for j in range(1, steps):
                a, logits, cache = drafter.draft_step(a, tokens[j][:, t : t + 1], cache)
                assert cache.length == t + 1 + j
                torch.testing.assert_close(logits[:, 0], unrolled[j][:, t], atol=1e-5, rtol=0)


def test_tree_expansion_with_a_full_mask_equals_chains(target):
    """EAGLE-2 style: siblings share a position; a depth-2 node sees only its own ancestor among
    draft entries."""
    drafter = make_objective(target).module
    for p in drafter.parameters():
        p.data.normal_(0, 0.1)
    g = torch.Generator().manual_seed(6)
    P, H = 5, target.hidden_size
    feats = torch.randn(1, P, 3 * H, generator=g)
    ids = torch.randint(0, target.vocab_size, (1, P), generator=g)
    kids = torch.randint(0, target.vocab_size, (1, 2), generator=g)  # depth-1 tokens A, B
    grandkids = torch.randint(
        0, target.vocab_size, (1, 2), generator=g
    )  # A1 (child of A), B1 (child of B)
    with torch.no_grad():
        hidden, _, prefix = drafter.draft_step(drafter.fuse(feats), ids)
        root = hidden[:, -1:].expand(1, 2, H)
        d1, _, c1 = drafter.draft_step(
            root,
            kids,
            prefix,
            positions=torch.full((1, 2), P),
            tree_mask=torch.eye(2, dtype=torch.bool),
        )
        full = torch.zeros(2, P + 4, dtype=torch.bool)
        full[:, :P] = True
        full[0, P], full[1, P + 1] = True, True  # ancestors: A for A1, B for B1
        full[0, P + 2], full[1, P + 3] = True, True  # themselves
        _, tree_logits, _ = drafter.draft_step(
            d1, grandkids, c1, positions=torch.full((1, 2), P + 1), tree_mask=full
        )
        for i in range(2):
            a, _, chain = drafter.draft_step(hidden[:, -1:], kids[:, i : i + 1], prefix)
            _, chain_logits, _ = drafter.draft_step(a, grandkids[:, i : i + 1], chain)
            torch.testing.assert_close(tree_logits[:, i], chain_logits[:, 0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="tree_mask must be"):
        drafter.draft_step(d1, grandkids, c1, tree_mask=torch.ones(2, 3, dtype=torch.bool))


def test_export_round_trip_is_exact(tmp_path, target):
    objective = make_objective(target)
    for p in objective.module.parameters():
        p.data.normal_(0, 0.05)
    module = SimpleNamespace(
        drafter=objective.module, objective=objective, run_info={"target": target.identity()}
    )
    out = export_from_module(module, tmp_path / "export", training={"steps": 0})
    config, state = read_export(out)
    assert config["method"] == "eagle3" and config["architecture"]["target_layers"] == list(LAYERS)
    assert state["d2t"].dtype == torch.long and state["t2d"].dtype == torch.bool
    loaded, _ = Eagle3Drafter.from_export(out, embed_weight=target.embed_weight)
    assert loaded.config == objective.module.config
    feats = torch.randn(2, 6, 3 * target.hidden_size)
    tokens = [torch.randint(0, target.vocab_size, (2, 6)) for _ in range(2)]
    with torch.no_grad():
        a = [objective.module.logits(h) for h in objective.module.ttt_forward(feats, tokens)]
        b = [loaded.logits(h) for h in loaded.ttt_forward(feats, tokens)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(loaded.d2t, objective.module.d2t) and torch.equal(
        loaded.t2d, objective.module.t2d
    )


def test_validate_and_bad_layers(target):
    with pytest.raises(ValueError, match="ttt_steps"):
        get_recipe("eagle3").validate(recipe_cfg(ttt_steps=0))
    with pytest.raises(ValueError, match="step_decay"):
        get_recipe("eagle3").validate(recipe_cfg(step_decay=0.0))
    with pytest.raises(
        ValueError, match=r"drafter\.target_layers=\[\] is out of range: allowed one or more"
    ):
        get_recipe("eagle3").validate(recipe_cfg(target_layers=[]))
    get_recipe("eagle3").validate(recipe_cfg())
    with pytest.raises(ValueError, match="outside 0..3"):
        eagle3_recipe.build_objective(
            recipe_cfg(target_layers=[1, 2, 4]), target, vocab_batches(target.vocab_size)
        )
    with pytest.raises(ValueError, match="needs d2t/t2d"):
        Eagle3Drafter(
            Eagle3Config(
                hidden_size=8,
                vocab_size=10,
                intermediate_size=8,
                num_attention_heads=2,
                num_key_value_heads=1,
                draft_vocab_size=4,
                target_layers=(1,),
            ),
            torch.zeros(10, 8),
        )
