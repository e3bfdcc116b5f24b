"""Objective seams for the coming methods: parameter groups, extra frozen models, own features, batch kinds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from draftsmith.distill.datamodule import DATAMODULES, build_datamodule, register_batch_kind
from draftsmith.distill.module import DistillModule
from draftsmith.distill.objective import batch_kind, frozen_models, optimizer_groups
from draftsmith.distill.target import FeatureTaps


class TwoPartObjective:
    """Heads and an 'adapter' trained at different learning rates, a frozen reference model, own features."""

    taps = FeatureTaps(final_hidden=True)
    batch_kind = "pairs_for_test"

    def __init__(self, groups: str = "ok") -> None:
        self.module = nn.ModuleDict({"heads": nn.Linear(4, 4), "adapter": nn.Linear(4, 4)})
        self.frozen = {"reference": nn.Linear(4, 4)}
        self.groups = groups
        self.features_calls = 0

    def param_groups(self):
        heads, adapter = list(self.module["heads"].parameters()), list(self.module["adapter"].parameters())
        if self.groups == "stray":
            return [{"params": heads + list(self.frozen["reference"].parameters())}, {"params": adapter}]
        if self.groups == "missing":
            return [{"params": heads}]
        return [{"params": heads}, {"params": adapter, "lr_scale": 0.1}]

    def features(self, target, batch):
        self.features_calls += 1
        return batch["input_ids"].float()

    def loss(self, batch, feats):
        out = self.module["adapter"](self.module["heads"](feats[:, :4]))
        return out.pow(2).mean(), {}

    def export_config(self):
        return {"method": "test", "architecture": {}}


def test_param_groups_set_learning_rates_and_refuse_foreign_parameters():
    groups = optimizer_groups(TwoPartObjective(), 1e-3)
    assert [g["lr"] for g in groups] == pytest.approx([1e-3, 1e-4]) and len(groups[0]["params"]) == 2
    with pytest.raises(ValueError, match="frozen or foreign"):
        optimizer_groups(TwoPartObjective("stray"), 1e-3)
    with pytest.raises(ValueError, match="2 trainable parameters are in no param group"):
        optimizer_groups(TwoPartObjective("missing"), 1e-3)

    class Plain:
        module = nn.Linear(2, 2)

    assert len(optimizer_groups(Plain(), 0.5)) == 1 and optimizer_groups(Plain(), 0.5)[0]["lr"] == 0.5
    assert batch_kind(Plain()) == "chat" and frozen_models(Plain()) == {}


def test_the_module_uses_groups_frozen_models_and_own_features():
    objective = TwoPartObjective()
    module = DistillModule(objective, target=object(), optim={"lr": 1e-2}, total_steps=10)
    optimizer = module.configure_optimizers()["optimizer"]
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([1e-2, 1e-3])
    assert not any(k.startswith("reference") or "frozen" in k for k in module.state_dict())  # never saved
    module.on_fit_start = lambda: None  # no target to move here
    batch = {"input_ids": torch.randn(2, 6), "attention_mask": torch.ones(2, 6), "loss_mask": torch.ones(2, 6)}
    loss, _ = module._step(batch)
    assert objective.features_calls == 1 and loss.requires_grad


def test_datamodules_are_chosen_by_batch_kind():
    assert "chat" in DATAMODULES
    with pytest.raises(ValueError, match="unknown batch kind 'rollouts'; registered: .*chat"):
        build_datamodule(None, None, kind="rollouts")
    made = []

    @register_batch_kind("pairs_for_test")
    def build_pairs(cfg, tokenizer, packing):
        made.append((cfg, tokenizer))
        return "pairs-datamodule"

    try:
        assert build_datamodule("cfg", "tok", kind=batch_kind(TwoPartObjective())) == "pairs-datamodule"
        with pytest.raises(ValueError, match="batch kind 'pairs_for_test' is registered twice"):
            register_batch_kind("pairs_for_test")(build_pairs)
    finally:
        DATAMODULES.unregister("pairs_for_test")


def test_the_causal_lm_target_is_one_implementation_of_the_target_protocol(tiny_target_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from draftsmith.distill.target import Target, TargetModel

    target = Target(AutoModelForCausalLM.from_pretrained(tiny_target_dir), tiny_tokenizer, str(tiny_target_dir))
    assert isinstance(target, TargetModel)
    assert not isinstance(object(), TargetModel)
    assert not any(p.requires_grad for p in target.parameters())  # frozen: nothing of it can reach the optimizer
