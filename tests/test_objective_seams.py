"""Objective seams for the coming methods: parameter groups, extra frozen models, own features,
batch kinds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from draftsmith.distill.data.datamodule import DATAMODULES, build_datamodule, register_batch_kind
from draftsmith.distill.engine.module import DistillModule
from draftsmith.distill.engine.objective import (
    Objective,
    batch_kind,
    frozen_models,
    optimizer_groups,
)
from draftsmith.distill.target.frozen import FeatureTaps

pytestmark = pytest.mark.unit


class TwoPartObjective(Objective):
    """Heads and an 'adapter' trained at different learning rates, a frozen reference model, own
    features."""

    taps = FeatureTaps(final_hidden=True)
    batch_kind = "pairs_for_test"

    def __init__(self, groups: str = "ok") -> None:
        self.module = nn.ModuleDict({"heads": nn.Linear(4, 4), "adapter": nn.Linear(4, 4)})
        self.frozen = {"reference": nn.Linear(4, 4)}
        self.groups = groups
        self.features_calls = 0

    def param_groups(self):
        heads, adapter = (
            list(self.module["heads"].parameters()),
            list(self.module["adapter"].parameters()),
        )
        if self.groups == "stray":
            return [
                {"params": heads + list(self.frozen["reference"].parameters())},
                {"params": adapter},
            ]
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
    assert [g["lr"] for g in groups] == pytest.approx([1e-3, 1e-4]) and len(
        groups[0]["params"]
    ) == 2
    with pytest.raises(ValueError, match="frozen or foreign"):
        optimizer_groups(TwoPartObjective("stray"), 1e-3)
    with pytest.raises(ValueError, match="2 trainable parameters are in no param group"):
        optimizer_groups(TwoPartObjective("missing"), 1e-3)

    class Plain:
        module = nn.Linear(2, 2)

    assert (
        len(optimizer_groups(Plain(), 0.5)) == 1 and optimizer_groups(Plain(), 0.5)[0]["lr"] == 0.5
    )
    assert batch_kind(Plain()) == "chat" and frozen_models(Plain()) == {}


def test_the_module_uses_groups_frozen_models_and_own_features():
    objective = TwoPartObjective()
    module = DistillModule(objective, target=object(), optim={"lr": 1e-2}, total_steps=10)
    optimizer = module.configure_optimizers()["optimizer"]
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([1e-2, 1e-3])
    assert not any(
        k.startswith("reference") or "frozen" in k for k in module.state_dict()
    )  # never saved
    module.on_fit_start = lambda: None  # no target to move here
    batch = {
        "input_ids": torch.randn(2, 6),
        "attention_mask": torch.ones(2, 6),
        "loss_mask": torch.ones(2, 6),
    }
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
        assert (
            build_datamodule("cfg", "tok", kind=batch_kind(TwoPartObjective()))
            == "pairs-datamodule"
        )
        with pytest.raises(ValueError, match="batch kind 'pairs_for_test' is registered twice"):
            register_batch_kind("pairs_for_test")(build_pairs)
    finally:
        DATAMODULES.unregister("pairs_for_test")


def assert_signatures_follow(implementation: type, protocol: type) -> None:
    """Every public method of ``protocol`` exists on ``implementation`` with the protocol's
    parameters first; any extra parameter is optional."""
    import inspect

    for name, member in vars(protocol).items():
        if callable(member) and not name.startswith("_"):
            ours, promised = (
                inspect.signature(getattr(implementation, name)).parameters,
                inspect.signature(member).parameters,
            )
            assert list(ours)[: len(promised)] == list(promised), name
            assert all(
                p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                for p in list(ours.values())[len(promised) :]
            ), name


def test_the_causal_lm_target_is_one_implementation_of_the_target_protocol(
    tiny_target_dir, tiny_tokenizer
):
    from transformers import AutoModelForCausalLM

    from draftsmith.distill.target.frozen import Target, TargetModel

    target = Target(
        AutoModelForCausalLM.from_pretrained(tiny_target_dir), tiny_tokenizer, str(tiny_target_dir)
    )
    assert isinstance(target, TargetModel)
    assert not isinstance(object(), TargetModel)
    assert not any(
        p.requires_grad for p in target.parameters()
    )  # frozen: nothing of it can reach the optimizer
    # Behaviour, not only names: every protocol member has the protocol's signature and answers as
    # it promises.
    assert_signatures_follow(Target, TargetModel)
    h, v, n = target.hidden_size, target.vocab_size, target.num_layers
    assert target.lm_head_weight.shape == target.embed_weight.shape == (v, h)
    assert {"vocab_size", "hidden_size", "num_hidden_layers"} <= set(target.identity())
    ids = torch.randint(0, v, (2, 5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    feats = target.features(
        ids,
        mask,
        FeatureTaps(final_hidden=True, prenorm_hidden=True, layers=(0, n - 1), logits=True, topk=3),
    )
    assert feats.final_hidden.shape == feats.prenorm_hidden.shape == (2, 5, h)
    assert set(feats.layer_hidden) == {0, n - 1} and all(
        t.shape == (2, 5, h) for t in feats.layer_hidden.values()
    )
    assert feats.logits.shape == (
        2,
        5,
        v,
    ) and feats.topk_indices.shape == feats.topk_values.shape == (2, 5, 3)
    assert not any(
        t.requires_grad for t in (feats.final_hidden, feats.logits)
    )  # detached, no-grad forward
    assert torch.equal(feats.topk_indices[..., 0], feats.logits.argmax(-1))
    bare = target.features(ids, mask, FeatureTaps(final_hidden=True))
    assert (
        bare.logits is None
        and bare.layer_hidden == {}
        and torch.allclose(bare.final_hidden, feats.final_hidden)
    )


def test_every_recipe_objective_is_an_objective_with_working_default_hooks():
    import importlib
    import importlib.util

    from draftsmith.recipes import RECIPES
    from draftsmith.recipes.registration import resolve

    for name, recipe in RECIPES.items():
        build = resolve(recipe.build_at)
        # a recipe's objective lives beside its build: in the build's module or objective.py
        package = build.__module__.rsplit(".", 1)[0]
        homes = {build.__module__, f"{package}.objective"}
        objective_types = [
            t
            for home in homes
            if importlib.util.find_spec(home) is not None
            for t in vars(importlib.import_module(home)).values()
            if isinstance(t, type) and t.__name__.endswith("Objective") and t.__module__ == home
        ]
        assert objective_types and all(issubclass(t, Objective) for t in objective_types), name
    plain = TwoPartObjective()
    plain.set_step(3)
    plain.on_validation_start()
    plain.on_validation_end(None)
    assert plain.own_features and not Objective.own_features.fget(NanFreeObjective())


class NanFreeObjective(Objective):
    """The smallest objective: the base's defaults for everything but the loss."""

    module = nn.Linear(2, 2)
    taps = FeatureTaps()
