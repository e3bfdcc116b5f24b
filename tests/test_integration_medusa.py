"""Integration tier on the embedded SmolLM2-135M target: real chat data, real heads, real export."""

from __future__ import annotations

import pytest
import torch

from draftsmith.distill.data.conversations import load_conversations
from draftsmith.distill.data.samples import tokenize_conversation
from draftsmith.distill.engine.exporting import export_from_module
from draftsmith.distill.target.frozen import Target
from draftsmith.export.format import TargetMismatchError, read_export
from draftsmith.export.target_check import check_target
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
from draftsmith.recipes.medusa.objective import MedusaObjective, default_tree

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def target() -> Target:
    return Target.load("smollm2-135m", "bf16")


@pytest.fixture(scope="module")
def real_batch(target) -> dict[str, torch.Tensor]:
    conversations, _ = load_conversations("sharegpt", limit=40)
    rows = [tokenize_conversation(target.tokenizer, c, 96) for c in conversations]
    rows = [r for r in rows if len(r["input_ids"]) == 96 and sum(r["loss_mask"]) > 32][:4]
    assert len(rows) == 4
    ids = torch.tensor([r["input_ids"] for r in rows])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.tensor([r["loss_mask"] for r in rows]),
    }


def test_target_taps_on_the_embedded_model(target, real_batch):
    from draftsmith.distill.target.frozen import FeatureTaps

    ids = real_batch["input_ids"][:1, :16]
    feats = target.features(
        ids, None, FeatureTaps(prenorm_hidden=True, layers=(2, 15, 27), logits=True)
    )
    assert feats.final_hidden.shape == (1, 16, 576) and feats.logits.shape == (1, 16, 49152)
    # final_hidden is the normed prenorm state, and the logits are the LM head of final_hidden.
    norm = target.model.model.norm
    assert torch.allclose(norm(feats.prenorm_hidden), feats.final_hidden, atol=1e-2)
    assert torch.allclose(
        target.model.lm_head(feats.final_hidden).float(), feats.logits.float(), atol=1e-2
    )
    assert not any(p.requires_grad for p in target.parameters())


def test_medusa_heads_learn_on_a_fixed_real_batch(target, real_batch, tmp_path):
    arch = MedusaConfig(hidden_size=576, vocab_size=49152, num_heads=2)
    objective = MedusaObjective(
        MedusaHeads(arch, target.lm_head_weight.float()),
        0.8,
        "dataset",
        5,
        default_tree(2, 8, 10),
        {"top_k": 10, "verifier": "greedy"},
    )
    feats = target.features(real_batch["input_ids"], real_batch["attention_mask"], objective.taps)
    opt = torch.optim.AdamW(objective.module.parameters(), lr=1e-3)
    losses = []
    for _ in range(8):
        loss, _ = objective.loss(real_batch, feats)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.85 * losses[0], losses

    class Live:
        drafter, run_info = objective.module, {"target": target.identity()}

    Live.objective = objective
    out = export_from_module(Live, tmp_path / "export", training={"steps": 8})
    config, _ = read_export(out)
    check_target(config, target.identity())
    reloaded, _ = MedusaHeads.from_export(out)
    hidden = feats.final_hidden[0, :5].float()
    assert torch.equal(reloaded(hidden), objective.module(hidden))
    config["target"]["num_hidden_layers"] = 12
    with pytest.raises(TargetMismatchError, match="num_hidden_layers"):
        check_target(config, target.identity())
