"""EAGLE-1 drafter: feature/token alignment of the loss, KV cache, training signal, export round
trip, and the runtime's serving step against the drafter's own forward."""

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
from test_eagle3_serving_step import compare_steps

from draftsmith.distill.engine.exporting import export_from_module
from draftsmith.distill.target.frozen import Target, TargetFeatures
from draftsmith.drafters.eagle import EagleConfig, EagleDrafter, KVCache
from draftsmith.export.format import ExportError, read_export
from draftsmith.recipes import get_recipe
from draftsmith.recipes.eagle import Eagle
from draftsmith.recipes.eagle import objective as eagle_recipe
from draftsmith.runtime.drafting.eagle_adapters import Eagle1DraftModel

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def recipe_cfg(**drafter) -> Eagle:
    """The shipped recipe's config (its schema and conf/recipe/eagle.yaml) with drafter
    overrides."""
    return recipe_config("eagle", {"drafter": drafter})


@pytest.fixture()
def target(tiny_tokenizer) -> Target:
    return Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")


def make_objective(target: Target, **drafter) -> eagle_recipe.EagleObjective:
    torch.manual_seed(0)
    objective = eagle_recipe.build(recipe_cfg(**drafter), target)
    objective.module.eval()  # no input noise unless a test turns training on
    return objective


def test_config_from_target_and_frozen_weights_are_not_exported(target):
    drafter = make_objective(target).module
    c = drafter.config
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        64,
        4,
        2,
        16,
    )
    assert c.vocab_size == target.vocab_size
    assert drafter.fc.weight.shape == (64, 128) and drafter.fc.bias is not None
    assert not hasattr(drafter.layer, "input_layernorm")
    keys = set(drafter.state_dict())
    assert not any("embed" in k or "lm_head" in k for k in keys)
    assert all(p.requires_grad for p in drafter.parameters())
    assert sum(p.numel() for p in drafter.parameters()) == sum(
        v.numel() for v in drafter.state_dict().values()
    )
    with pytest.raises(ValueError, match="lm_head_weight has shape"):
        EagleDrafter(c, target.embed_weight, torch.zeros(3, 64))


def test_loss_uses_pairs_f_t_x_t1_targets_at_t1_and_label_mask_at_t2(target):
    """Hand-check which (f_t, x_{t+1}) pairs and which targets the loss scores, with known random
    tensors."""
    objective = make_objective(target)
    drafter = objective.module
    g = torch.Generator().manual_seed(1)
    B, T, H, V = 2, 9, target.hidden_size, target.vocab_size
    ids = torch.randint(5, V, (B, T), generator=g)
    final = torch.randn(B, T, H, generator=g)
    logits = torch.randn(B, T, V, generator=g)
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 1, 1], [0, 1, 1, 1, 1, 1, 1, 0, 0]])
    attn = torch.tensor([[1] * 9, [1] * 7 + [0, 0]])  # row 1 is right-padded
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}
    loss, metrics = objective.loss(batch, TargetFeatures(final_hidden=final, logits=logits))

    feat_terms, tok_terms, scored = [], [], []
    with torch.no_grad():
        for b in range(B):
            for t in range(T - 2):  # the last pair (t = T-2) has no label x_T
                if not (loss_mask[b, t + 2] and attn[b, t + 2]):
                    continue
                pred, _ = drafter(
                    ids[b : b + 1, 1 : t + 2], final[b : b + 1, : t + 1]
                )  # causal prefix run
                f_hat = pred[0, -1]
                feat_terms.append(F.smooth_l1_loss(f_hat, final[b, t + 1]))
                p = F.softmax(logits[b, t + 1], -1)
                tok_terms.append(-(p * F.log_softmax(drafter.logits(f_hat), -1)).sum())
                scored.append((b, t))
    assert scored == [
        (0, 1),
        (0, 2),
        (0, 3),
        (0, 5),
        (0, 6),
        (1, 0),
        (1, 1),
        (1, 2),
        (1, 3),
        (1, 4),
    ]
    feat, tok = torch.stack(feat_terms).mean(), torch.stack(tok_terms).mean()
    assert torch.allclose(metrics["feature_loss"], feat, atol=1e-5)
    assert torch.allclose(metrics["token_loss"], tok, atol=1e-5)
    assert torch.allclose(loss, 1.0 * feat + 0.1 * tok, atol=1e-5)

    # The last position's feature/logits and everything under padding never reach the loss.
    final2, logits2 = final.clone(), logits.clone()
    final2[:, -1] += 100.0
    logits2[:, -1] += 100.0
    final2[1, 7:] = 55.0
    logits2[1, 7:] = -55.0
    loss2, _ = objective.loss(batch, TargetFeatures(final_hidden=final2, logits=logits2))
    assert torch.equal(loss, loss2)


def test_noise_only_in_training_mode(target):
    objective = make_objective(target)
    ids = torch.randint(5, target.vocab_size, (1, 12))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
    }
    feats = target.features(ids, batch["attention_mask"], objective.taps)
    eval_a, _ = objective.loss(batch, feats)
    eval_b, _ = objective.loss(batch, feats)
    assert torch.equal(eval_a, eval_b)
    objective.module.train()
    torch.manual_seed(3)
    noisy, _ = objective.loss(batch, feats)
    assert not torch.equal(noisy, eval_a)
    features = torch.zeros(2, 256, 8)
    noise = eagle_recipe.uniform_feature_noise(features, 0.2, 512)
    # (U-0.5) * 0.2 * 512/256 spans +-0.2
    assert noise.abs().max() <= 0.2 and noise.abs().max() > 0.15


def test_kv_cache_and_tree_mask_match_full_forward(target):
    drafter = make_objective(target).module
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(5, target.vocab_size, (2, 7), generator=g)
    feats = torch.randn(2, 7, target.hidden_size, generator=g)
    with torch.no_grad():
        full, cache = drafter(ids, feats)
        assert isinstance(cache, KVCache) and cache.length == 7
        pre, c4 = drafter(ids[:, :4], feats[:, :4])
        rest, c7 = drafter(ids[:, 4:], feats[:, 4:], past_kv=c4)
        assert c4.length == 4 and c7.length == 7  # the input cache is not mutated
        torch.testing.assert_close(torch.cat((pre, rest), 1), full, atol=1e-5, rtol=1e-5)
        one, _ = drafter(ids[:, 4:5], feats[:, 4:5], past_kv=c7.crop(4))
        torch.testing.assert_close(one[:, 0], full[:, 4], atol=1e-5, rtol=1e-5)
        # Two siblings at the same position (a draft tree): each sees the prefix and itself only.
        sib_ids = torch.stack((ids[:, 4], ids[:, 5]), 1)
        sib_feats = torch.stack((feats[:, 4], feats[:, 5]), 1)
        tree = torch.eye(2, dtype=torch.bool)
        sib, _ = drafter(
            sib_ids, sib_feats, past_kv=c4, positions=torch.full((2, 2), 4), tree_mask=tree
        )
        alt, _ = drafter(ids[:, 5:6], feats[:, 5:6], past_kv=c4)
        torch.testing.assert_close(sib[:, 0], full[:, 4], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sib[:, 1], alt[:, 0], atol=1e-5, rtol=1e-5)
        kept = c7.select(torch.tensor([0, 1, 2, 3]))
        assert torch.equal(kept.key, c4.key)
    with pytest.raises(ValueError, match="crop"):
        c4.crop(9)


def test_a_few_steps_lower_the_loss(target):
    objective = make_objective(target, noise_std=0.0)
    objective.module.train()
    torch.manual_seed(0)
    ids = torch.randint(5, target.vocab_size, (4, 24))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
    }
    feats = target.features(ids, batch["attention_mask"], objective.taps)
    opt = torch.optim.AdamW(objective.module.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss, metrics = objective.loss(batch, feats)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.75 * losses[0], losses
    assert 0.0 <= float(metrics["top1"]) <= 1.0 and metrics["top1"] <= metrics["top5"]


def test_export_round_trip_is_exact(tmp_path, target):
    objective = make_objective(target)
    for p in objective.module.parameters():
        p.data.normal_(0, 0.05)
    module = SimpleNamespace(
        drafter=objective.module, objective=objective, run_info={"target": target.identity()}
    )
    out = export_from_module(module, tmp_path / "export", training={"steps": 0})
    config, state = read_export(out)
    assert config["method"] == "eagle" and config["inference"]["proposer"] == "eagle_dynamic_tree"
    assert not any("embed" in k or "lm_head" in k for k in state)
    loaded, _ = EagleDrafter.from_export(
        out, embed_weight=target.embed_weight, lm_head_weight=target.lm_head_weight
    )
    assert loaded.config == objective.module.config
    ids = torch.randint(5, target.vocab_size, (2, 6))
    feats = torch.randn(2, 6, target.hidden_size)
    with torch.no_grad():
        a, _ = objective.module(ids, feats)
        b, _ = loaded(ids, feats)
    assert torch.equal(objective.module.logits(a), loaded.logits(b))
    with pytest.raises(ExportError, match="not eagle"):
        from draftsmith.export.format import write_export

        write_export(
            tmp_path / "m",
            {},
            {"method": "medusa", "architecture": {}, "target": {"name_or_path": "tiny"}},
        )
        EagleDrafter.from_export(
            tmp_path / "m", embed_weight=target.embed_weight, lm_head_weight=target.lm_head_weight
        )


def test_validate_rejects_bad_weights():
    with pytest.raises(ValueError, match="feature_weight"):
        get_recipe("eagle").validate(recipe_cfg(feature_weight=0.0, token_weight=0.0))
    with pytest.raises(ValueError, match="noise_std"):
        get_recipe("eagle").validate(recipe_cfg(noise_std=-1.0))
    get_recipe("eagle").validate(recipe_cfg())
    with pytest.raises(ValueError, match="multiple of"):
        EagleConfig(
            hidden_size=64,
            vocab_size=10,
            intermediate_size=8,
            num_attention_heads=4,
            num_key_value_heads=3,
        )


@pytest.mark.e2e  # a train.py / draftsmith subprocess
def test_train_py_end_to_end(tmp_path, tiny_target_dir, tiny_data_file):
    """Hydra composition + Lightning (with input noise on) + export for recipe=eagle."""
    run_dir = tmp_path / "run"
    code = (
        "import sys, runpy; import draftsmith.recipes.eagle; sys.argv = ['train.py'] +"
        f" sys.argv[1:]; runpy.run_path({str(ROOT / 'train.py')!r}, run_name='__main__')"
    )
    overrides = [
        "recipe=eagle",
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
    assert config["method"] == "eagle" and config["target"]["name_or_path"] == str(tiny_target_dir)
    assert "fc.bias" in state and not any("embed" in k or "lm_head" in k for k in state)


def test_eagle1_serving_step_equals_the_drafters_own_forward():
    """The EAGLE-1 runtime step (fused q/k/v and gate/up, RoPE tables, static KV) gives the
    drafter's own forward and logits (fp32)."""
    torch.manual_seed(0)
    cfg = EagleConfig(
        hidden_size=32,
        vocab_size=50,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    drafter = EagleDrafter(cfg, torch.randn(50, 32), torch.randn(50, 32)).eval()
    model = Eagle1DraftModel(drafter)

    def reference(hidden, ids, cache, positions, mask):
        out, cache = drafter(ids, hidden, past_kv=cache, positions=positions, tree_mask=mask)
        return out, drafter.logits(out), cache

    compare_steps(
        lambda h, i, c, p, m: model.step(h, i, c, p, m, last_only=False),
        reference,
        32,
        torch.float32,
        {"atol": 1e-5, "rtol": 1e-5},
        lambda f: f[None, :, :32],
    )
