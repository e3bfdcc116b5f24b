"""Medusa heads, their loss alignment, training signal and export round trip (tiny in-process
models)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_llama, train_on_fixed_batch
from safetensors.torch import load_file

from draftsmith.distill.engine.exporting import export_from_module
from draftsmith.distill.target.frozen import FeatureTaps, Target
from draftsmith.export.format import ExportError, TargetMismatchError, read_export, write_export
from draftsmith.export.medusa_layout import to_medusa_layout
from draftsmith.export.target_check import check_target
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
from draftsmith.recipes.medusa.objective import MedusaObjective, default_tree

pytestmark = pytest.mark.unit


@pytest.fixture()
def target(tiny_tokenizer) -> Target:
    return Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")


def make_objective(
    target: Target, labels: str = "dataset", num_heads: int = 3, share: bool = False
) -> MedusaObjective:
    arch = MedusaConfig(
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        num_heads=num_heads,
        share_lm_head=share,
    )
    heads = MedusaHeads(arch, target.lm_head_weight.float())
    return MedusaObjective(
        heads, 0.8, labels, 5, default_tree(num_heads, 8, 4), {"top_k": 4, "verifier": "greedy"}
    )


def test_heads_start_from_target_head_and_do_not_share_weights(target):
    heads = make_objective(target).module
    assert all(torch.equal(h.lm_head.weight, target.lm_head_weight) for h in heads.heads)
    assert all(torch.count_nonzero(h.blocks[0].linear.weight) == 0 for h in heads.heads)
    ptrs = {p.data_ptr() for p in heads.parameters()}
    assert len(ptrs) == len(list(heads.parameters())), "heads must not share parameters"
    deep = MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=16, num_heads=2, num_layers=3))
    assert len({b.linear.weight.data_ptr() for h in deep.heads for b in h.blocks}) == 6


def test_forward_shapes_and_shared_head_is_not_saved(target):
    heads = make_objective(target, share=True).module
    x = torch.randn(2, 5, target.hidden_size)
    assert heads(x).shape == (3, 2, 5, target.vocab_size)
    assert not any(k.startswith("shared") for k in heads.state_dict())
    with pytest.raises(ValueError, match="lm_head_weight"):
        MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=16, share_lm_head=True))


def test_loss_aligns_head_k_with_token_t_plus_k_plus_2(target):
    """Recompute the loss by hand: head k at position t is scored on input_ids[t+k+2] where
    loss_mask is 1."""
    objective = make_objective(target, num_heads=2)
    torch.manual_seed(0)
    for p in objective.module.parameters():
        p.data.normal_(0, 0.05)
    ids = torch.randint(5, target.vocab_size, (2, 9))
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1, 0]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
    feats = target.features(ids, batch["attention_mask"], FeatureTaps())
    loss, metrics = objective.loss(batch, feats)
    expected = 0.0
    for k in range(2):
        logits, labels = [], []
        for b in range(2):
            for t in range(9 - k - 2):
                if mask[b, t + k + 2]:
                    logits.append(objective.module.head_logits(feats.final_hidden[b, t], k))
                    labels.append(ids[b, t + k + 2])
        ce = F.cross_entropy(torch.stack(logits), torch.stack(labels))
        assert torch.allclose(metrics[f"head{k}/loss"], ce, atol=1e-5)
        expected = expected + 0.8 ** (k + 1) * ce
    assert torch.allclose(loss, expected, atol=1e-5)


def test_self_distillation_labels_use_target_argmax_at_previous_position(target):
    objective = make_objective(target, labels="target_argmax", num_heads=1)
    assert objective.taps.logits
    ids = torch.randint(5, target.vocab_size, (1, 7))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
    }
    feats = target.features(ids, batch["attention_mask"], objective.taps)
    _, metrics = objective.loss(batch, feats)
    greedy = feats.logits.argmax(-1)[0]  # greedy[s-1] is the target's guess for token s
    logits = objective.module.head_logits(feats.final_hidden[0, :-2], 0)
    assert torch.allclose(metrics["head0/loss"], F.cross_entropy(logits, greedy[1:-1]), atol=1e-5)


@pytest.mark.parametrize("labels", ["dataset", "target_argmax", "target_soft"])
def test_loss_goes_down_on_a_fixed_batch(target, labels):
    objective = make_objective(target, labels=labels)
    ids = torch.randint(5, target.vocab_size, (4, 24))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
    }
    feats = target.features(ids, batch["attention_mask"], objective.taps)
    losses = train_on_fixed_batch(objective, batch, feats)
    if labels == "target_soft":
        # Soft CE is bounded below by the (high) entropy of a random tiny teacher: check the excess
        # goes down.
        assert losses[-1] < losses[0] - 0.01 and losses == sorted(losses, reverse=True), losses
    else:
        assert losses[-1] < 0.7 * losses[0], losses


class _Module:
    def __init__(self, objective, target):
        self.drafter = objective.module
        self.objective = objective
        self.run_info = {"target": target.identity()}


def test_export_round_trip_is_exact_and_checks_target(tmp_path, target, tiny_tokenizer):
    objective = make_objective(target)
    for p in objective.module.parameters():
        p.data.normal_(0, 0.02)
    out = export_from_module(_Module(objective, target), tmp_path / "export", training={"steps": 1})
    config, state = read_export(out)
    assert config["method"] == "medusa" and config["target"]["vocab_size"] == target.vocab_size
    assert config["inference"]["tree"] and config["target"]["fingerprint"].startswith("sha256:")
    reloaded, _ = MedusaHeads.from_export(out)
    x = torch.randn(3, target.hidden_size)
    assert torch.equal(reloaded(x), objective.module(x))
    check_target(config, target.identity())
    other = Target(build_tiny_llama(len(tiny_tokenizer), seed=1), tiny_tokenizer, "other")
    with pytest.raises(TargetMismatchError, match="fingerprint"):
        check_target(config, other.identity())


def test_broken_exports_get_clear_errors(tmp_path):
    with pytest.raises(ExportError, match="does not exist"):
        read_export(tmp_path / "missing")
    good = write_export(
        tmp_path / "e",
        {"w": torch.ones(2)},
        {"method": "medusa", "architecture": {}, "target": {"name_or_path": "tiny"}},
    )
    (good / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ExportError, match="corrupt"):
        read_export(good)
    (good / "config.json").write_text("{not json")
    with pytest.raises(ExportError, match="not valid JSON"):
        read_export(good)
    assert not list(tmp_path.glob(".e.tmp-*")), "no temp folder may be left behind"


def test_medusa_engine_layout(tmp_path, target):
    objective = make_objective(target, num_heads=2)
    out = export_from_module(_Module(objective, target), tmp_path / "export", training={})
    layout = to_medusa_layout(out, tmp_path / "vllm")
    cfg = json.loads((layout / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["num_heads"] == 2 and cfg["num_hidden_layers"] == 1
    vllm = load_file(layout / "model.safetensors")
    assert not (
        layout / "medusa_lm_head.safetensors"
    ).exists()  # TGI's layout is --format medusa-tgi
    state = objective.module.state_dict()
    assert torch.equal(vllm["blocks.1.layers.0.weight"], state["heads.1.blocks.0.linear.weight"])
    assert torch.equal(vllm["lm_heads.1.weight"], state["heads.1.lm_head.weight"])
    assert set(vllm) == {
        f"blocks.{k}.layers.0.{p}" for k in range(2) for p in ("weight", "bias")
    } | {"lm_heads.0.weight", "lm_heads.1.weight"}


def test_default_tree_is_prefix_closed_and_sized():
    tree = default_tree(num_heads=3, num_nodes=12, top_k=10)
    assert len(tree) == 12 and len({tuple(p) for p in tree}) == 12
    assert all(tuple(p[:-1]) in {tuple(q) for q in tree} for p in tree if len(p) > 1)
    assert [0] in tree and max(len(p) for p in tree) <= 3
