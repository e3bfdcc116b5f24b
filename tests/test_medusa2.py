"""Medusa-2: heads + a LoRA on the target trained together; what trains, the export parts, the
identity, bad input."""

import sys

import pytest
import torch
from head_family_utils import fit_steps, fixed_batch, recipe_cfg

from draftsmith.common.errors import ConfigError
from draftsmith.distill.target.frozen import Target
from draftsmith.distill.target.lora import LoraSpec
from draftsmith.export.format import TargetMismatchError, read_export_parts
from draftsmith.export.target_check import check_target

pytestmark = pytest.mark.unit

pytest.importorskip("peft")


@pytest.fixture()
def fresh_target(tiny_target_dir, tiny_tokenizer):
    """A target of its own per test: Medusa-2 changes the target it is given."""
    from transformers import AutoModelForCausalLM

    return Target(
        AutoModelForCausalLM.from_pretrained(tiny_target_dir), tiny_tokenizer, str(tiny_target_dir)
    )


def medusa2_cfg(**heads):
    return recipe_cfg(
        "medusa2",
        heads={"num_heads": 2, "warmup_steps": 2, **heads},
        adapter={"rank": 4, "target_modules": ["q_proj", "v_proj"]},
        inference={"tree_nodes": 4, "top_k": 3},
    )


def check_only_lora_and_heads_train(objective, target) -> None:
    """The optimizer holds exactly the LoRA parameters and the heads; only the LoRA of the target
    needs grad."""
    from draftsmith.distill.engine.objective import optimizer_groups

    groups = optimizer_groups(objective, 1e-3)
    # heads at lr_multiplier x the adapter's LR
    assert [g["lr"] for g in groups] == pytest.approx([4e-3, 1e-3])
    trainable = {id(p) for p in target.model.parameters() if p.requires_grad}
    lora = {id(p) for n, p in target.model.named_parameters() if "lora_" in n}
    assert trainable == lora and len(lora) == 4 * 2 * 2  # 4 layers x (q, v) x (A, B)
    assert {id(p) for g in groups for p in g["params"]} == lora | {
        id(p) for p in objective.module.heads.parameters()
    }


def train_and_check_losses(objective, target) -> dict:
    """Fit a fixed batch: heads-only warmup, then the backbone loss joins; the base weights never
    move and the adapter trains. Returns the batch."""
    base = {k: v.clone() for k, v in target.model.state_dict().items() if "lora_" not in k}
    batch = fixed_batch(target.vocab_size, period=5)
    losses = fit_steps(objective, target, batch, 20, lr=1e-2)
    # heads-only warmup, then the backbone loss joins
    assert losses[1] < losses[0] and losses[2] > losses[1]
    # (the LoRA learns slowly from B = 0; the heads fast)
    assert losses[-1] < 0.9 * losses[2], losses
    after = target.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())  # the base weights never move
    # the adapter trained (B starts at 0)
    assert any(v.abs().sum() > 0 for k, v in after.items() if "lora_B" in k)
    return batch


def export_and_check_parts(objective, target, plain_identity, folder) -> tuple[dict, dict]:
    """Export: the heads and the adapter as separate parts; the plain target is refused, the
    adapted one accepted. Returns (config, parts)."""
    from draftsmith.distill.engine.exporting import export_from_module
    from draftsmith.distill.engine.module import DistillModule

    module = DistillModule(objective, target, {"lr": 1e-3}, total_steps=8)
    module.run_info = {"target": target.identity()}
    out = export_from_module(module, folder, training={"steps": 8})
    config, parts = read_export_parts(out)
    assert config["method"] == "medusa2" and set(parts) == {"model", "adapter"}
    assert all(k.startswith("heads.") for k in parts["model"])  # MedusaHeads' own keys
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in parts["adapter"]
    assert (
        config["inference"]["adapter"]["scaling"] == pytest.approx(16 / 4)
        and config["inference"]["lossy"]
    )
    with pytest.raises(TargetMismatchError, match="changes its target .*lora"):
        check_target(config, plain_identity)
    check_target(config, target.identity())  # the adapted target it was trained with
    return config, parts


def check_merged_adapter_and_disabled_adapter(target, config, parts, ids) -> None:
    """The runtime's path: merging the part into the plain weights reproduces the adapted target's
    logits; with adapters disabled (self-distillation's teacher) it is the original target."""
    from transformers import AutoModelForCausalLM

    from draftsmith.export.adapter import merge_lora

    plain = AutoModelForCausalLM.from_pretrained(target.name_or_path)
    plain.load_state_dict(
        merge_lora(plain.state_dict(), parts["adapter"], config["inference"]["adapter"]["scaling"])
    )
    with torch.no_grad():
        adapted = target.model(ids).logits
        torch.testing.assert_close(plain(ids).logits, adapted, rtol=1e-4, atol=1e-4)
        # Self-distillation's teacher: the same model with adapters disabled is the original target.
        with target.adapter_disabled():
            original = target.model(ids).logits
        torch.testing.assert_close(
            original, AutoModelForCausalLM.from_pretrained(target.name_or_path)(ids).logits
        )
    assert not torch.allclose(original, adapted)
    # re-enabled
    assert all(p.requires_grad for n, p in target.model.named_parameters() if "lora_" in n)


def test_medusa2_trains_only_lora_and_heads_and_its_export_refuses_the_plain_target(
    fresh_target, tmp_path
):
    from draftsmith.recipes import get_recipe

    plain_identity = fresh_target.identity()
    objective = get_recipe("medusa2").build(medusa2_cfg(), fresh_target)
    check_only_lora_and_heads_train(objective, fresh_target)
    batch = train_and_check_losses(objective, fresh_target)
    config, parts = export_and_check_parts(
        objective, fresh_target, plain_identity, tmp_path / "export"
    )
    check_merged_adapter_and_disabled_adapter(fresh_target, config, parts, batch["input_ids"][:1])


def test_self_distillation_loss_decreases(fresh_target):
    from draftsmith.recipes import get_recipe

    cfg = medusa2_cfg(warmup_steps=0)
    cfg.adapter.self_distill = True
    objective = get_recipe("medusa2").build(cfg, fresh_target)
    batch = fixed_batch(fresh_target.vocab_size)
    losses = fit_steps(objective, fresh_target, batch, 6)
    # The backbone term is a CE against the original target, which the adapted one equals at the
    # start (LoRA B = 0): it starts at its floor (the teacher's entropy), so the decrease is the
    # heads' (0.2 x ~1.4 x ~4.8 at the start).
    assert losses[-1] < losses[0] - 0.5, losses
    feats = objective.features(fresh_target, batch)
    assert feats.original_logits is not None and objective.self_distill


def test_bad_input_is_refused_before_training(fresh_target, monkeypatch):
    from draftsmith.recipes import get_recipe

    recipe = get_recipe("medusa2")
    with pytest.raises(ConfigError, match=r"adapter\.rank=0 is out of range: allowed >= 1"):
        recipe.validate(recipe_cfg("medusa2", adapter={"rank": 0}))
    with pytest.raises(
        ConfigError, match=r"target_modules \['qkv'\] match no linear layer .*q_proj"
    ):
        fresh_target.attach_lora(LoraSpec(rank=2, alpha=4, target_modules=("qkv",)))
    assert fresh_target.adapter is None and not any(
        p.requires_grad for p in fresh_target.parameters()
    )
    with pytest.raises(ConfigError, match="matches the LM head"):
        fresh_target.attach_lora(LoraSpec(rank=2, alpha=4, target_modules=("lm_head",)))
    monkeypatch.setitem(sys.modules, "peft", None)  # as if peft were not installed
    with pytest.raises(
        ConfigError, match=r"recipe=medusa2 needs the peft package.*draftsmith\[peft\]"
    ):
        recipe.validate(recipe_cfg("medusa2"))


def test_the_adapter_trains_in_fp32_on_a_bf16_target(tiny_target_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    target = Target(
        AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.bfloat16),
        tiny_tokenizer,
        "t",
    )
    adapter = target.attach_lora(LoraSpec(rank=2, alpha=4, target_modules=("v_proj",)))
    assert {p.dtype for p in adapter.parameters()} == {torch.float32}
    ids = torch.randint(5, 50, (1, 6))
    hidden = target.features(ids, torch.ones_like(ids), grad=True).final_hidden
    assert hidden.dtype == torch.bfloat16 and hidden.requires_grad
    hidden.float().pow(2).mean().backward()
    assert all(p.grad is not None for n, p in adapter.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        assert not target.features(
            ids, torch.ones_like(ids), grad=True
        ).final_hidden.requires_grad  # no-grad wins
