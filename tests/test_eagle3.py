"""EAGLE-3 drafter: draft vocabulary, TTT unrolling == step-by-step drafting, loss alignment,
export, training."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_llama
from recipe_configs import recipe_config
from transformers import LlamaConfig

from draftsmith.distill.engine.exporting import export_from_module
from draftsmith.distill.target.frozen import Target, TargetFeatures
from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Drafter, default_target_layers
from draftsmith.drafters.vocab import (
    count_assistant_tokens,
    draft_vocab_from_batches,
    select_draft_vocab,
    vocab_maps,
)
from draftsmith.export.format import read_export
from draftsmith.recipes import get_recipe
from draftsmith.recipes.eagle3 import Eagle3
from draftsmith.recipes.eagle3 import objective as eagle3_recipe

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
LAYERS = (1, 2, 3)  # the tiny target has 4 layers: the default (2, L//2, L-3) needs L >= 7


def recipe_cfg(**drafter) -> Eagle3:
    """The shipped recipe's config (its schema and conf/recipe/eagle3.yaml) with drafter
    overrides."""
    return recipe_config("eagle3", {"drafter": {"target_layers": list(LAYERS), **drafter}})


@pytest.fixture()
def target(tiny_tokenizer) -> Target:
    return Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")


def vocab_batches(vocab: int, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, 40), generator=g)
        ids[:, ::3] = 7  # token 7 is the most frequent assistant token
        out.append((ids, torch.ones_like(ids)))
    return out


def make_objective(
    target: Target, draft_vocab: int = 48, **drafter
) -> eagle3_recipe.Eagle3Objective:
    torch.manual_seed(0)
    cfg = recipe_cfg(draft_vocab_size=draft_vocab, **drafter)
    objective = eagle3_recipe.build_objective(cfg, target, vocab_batches(target.vocab_size))
    objective.module.eval()
    return objective


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


def two_step_setup(target: Target, length: int) -> tuple:
    """A 2-step TTT objective with a 60-token draft vocabulary and scrambled weights, and random
    inputs for 2 sequences of ``length``: (objective, generator, ids [2, T], layer hidden {i: [2, T,
    H]})."""
    objective = make_objective(target, draft_vocab=60, ttt_steps=2)
    for p in objective.module.parameters():
        p.data.normal_(0, 0.1)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, target.vocab_size, (2, length), generator=g)
    return (
        objective,
        g,
        ids,
        {i: torch.randn(2, length, target.hidden_size, generator=g) for i in LAYERS},
    )


def test_loss_alignment_per_ttt_step(target):
    """Step j, index t: token x_{t+1+j}, teacher logits at t+1+j (draft vocab), label mask at
    t+2+j."""
    objective, g, ids, layers = two_step_setup(target, 8)
    drafter = objective.module
    B, T, V = 2, 8, target.vocab_size
    logits = torch.randn(B, T, V, generator=g)
    draft_ids = drafter.draft_ids_in_target()
    best = draft_ids[
        torch.randint(0, 60, (B, T), generator=g)
    ]  # make the target's argmax draftable ...
    logits.scatter_add_(-1, best[..., None], torch.full((B, T, 1), 8.0))
    out_of_vocab = int((~drafter.t2d).nonzero()[0])
    logits[0, 3, out_of_vocab] = 50.0  # ... except at position 3
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 0]])
    attn = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}
    loss, metrics = objective.loss(batch, TargetFeatures(layer_hidden=layers, logits=logits))

    fused = torch.cat([layers[i] for i in LAYERS], -1)
    total, scored = 0.0, {0: [], 1: []}
    with torch.no_grad():
        for j in range(2):
            terms = []
            for b in range(B):
                for t in range(T - 2 - j):
                    if (
                        not loss_mask[b, t + 2 + j]
                        or not drafter.t2d[logits[b, t + 1 + j].argmax()]
                    ):
                        continue
                    hidden, step_logits, cache = drafter.draft_step(
                        drafter.fuse(fused[b : b + 1, : t + 1]), ids[b : b + 1, 1 : t + 2]
                    )
                    if j == 1:
                        _, step_logits, _ = drafter.draft_step(
                            hidden[:, -1:], ids[b : b + 1, t + 2 : t + 3], cache
                        )
                    p = F.softmax(logits[b, t + 1 + j, draft_ids], -1)
                    terms.append(-(p * F.log_softmax(step_logits[0, -1], -1)).sum())
                    scored[j].append((b, t))
            step_loss = torch.stack(terms).mean()
            torch.testing.assert_close(metrics[f"step{j}/loss"], step_loss, atol=1e-5, rtol=0)
            total = total + 0.8**j * step_loss
    assert scored[0] == [(0, 0), (0, 1), (0, 3), (0, 4), (0, 5), (1, 1), (1, 2), (1, 3), (1, 4)]
    assert scored[1] == [(0, 0), (0, 2), (0, 3), (0, 4), (1, 0), (1, 1), (1, 2), (1, 3)]
    torch.testing.assert_close(loss, total, atol=1e-5, rtol=0)


def fixed_batch_steps(objective, target: Target, steps: int = 20) -> tuple[list[float], list[dict]]:
    """``steps`` AdamW steps of ``objective`` on one fixed random batch: (losses, metrics of each
    step)."""
    objective.module.train()
    torch.manual_seed(0)
    ids = torch.randint(5, target.vocab_size, (4, 20))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
    }
    feats = target.features(ids, batch["attention_mask"], objective.taps)
    opt = torch.optim.AdamW(objective.module.parameters(), lr=3e-3)
    losses, metrics = [], []
    for _ in range(steps):
        loss, step_metrics = objective.loss(batch, feats)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        metrics.append(step_metrics)
    return losses, metrics


def test_a_few_steps_lower_the_loss(tiny_tokenizer):
    # A larger init makes the random target's distributions peaked, so the soft-CE floor (entropy)
    # is low.
    target = Target(
        build_tiny_llama(len(tiny_tokenizer), initializer_range=0.2), tiny_tokenizer, "tiny"
    )
    objective = make_objective(target)
    losses, metric_steps = fixed_batch_steps(objective, target)
    metrics = metric_steps[-1]
    assert losses[-1] < 0.75 * losses[0], losses
    assert {"step0/top1", "step1/top1", "step2/top1"} <= set(metrics)


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


@pytest.mark.e2e  # a train.py / draftsmith subprocess
def test_train_py_end_to_end(tmp_path, tiny_target_dir, tiny_data_file):
    """Hydra composition + Lightning + export for recipe=eagle3, with the draft vocab counted on the
    data."""
    run_dir = tmp_path / "run"
    code = (
        "import sys, runpy; import draftsmith.recipes.eagle3; sys.argv = ['train.py'] +"
        f" sys.argv[1:]; runpy.run_path({str(ROOT / 'train.py')!r}, run_name='__main__')"
    )
    overrides = [
        "recipe=eagle3",
        f"target.name_or_path={tiny_target_dir}",
        "target.dtype=fp32",
        f"data.spec={tiny_data_file}",
        "data.limit=null",
        "data.max_length=48",
        "data.batch_size=4",
        "data.val_fraction=0.1",
        "trainer.max_steps=3",
        "run.checkpoint_every=3",
        "run.final_eval_batches=1",
        "drafter.target_layers=[1,2,3]",
        "drafter.draft_vocab_size=40",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", code, *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "DRAFTSMITH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    config, state = read_export(run_dir / "export")
    assert config["method"] == "eagle3" and config["architecture"]["draft_vocab_size"] == 40
    assert int(state["t2d"].sum()) == 40 and state["lm_head.weight"].shape[0] == 40
