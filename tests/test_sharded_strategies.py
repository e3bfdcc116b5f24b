"""The sharded GPU strategies, checked by construction (Lightning refuses FSDP and DeepSpeed on a
CPU accelerator): the FSDP preset wraps each drafter layer and nothing of the frozen target (Medusa
and wrap classes by name included) in bf16 mixed precision, and the DeepSpeed presets build their
ZeRO stage and offload (the other presets and what every strategy shares: test_strategies.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from pytorch_lightning.strategies import FSDPStrategy, StrategyRegistry
from test_strategies import drafter_for

from draftsmith.cli.training import compose_config
from draftsmith.common.errors import ConfigError
from draftsmith.distill.cluster.strategies import (
    build_precision,
    build_strategy,
    layer_classes,
    resolve_precision,
)

pytestmark = pytest.mark.unit


needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed not installed (extra: deepspeed)",
)


@pytest.fixture(scope="module")
def tiny_target(tiny_tokenizer):
    from conftest import build_tiny_llama

    from draftsmith.distill.target.frozen import Target

    return Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")


def test_fsdp_preset_resolves_to_fsdp_strategy():
    cfg = compose_config(["recipe=medusa", "trainer=fsdp"])
    assert cfg.trainer.accelerator == "gpu" and cfg.trainer.precision == "auto"
    assert resolve_precision(cfg.trainer, cuda_available=True, cuda_bf16=True)[0] == "bf16-mixed"
    assert isinstance(StrategyRegistry.get(cfg.trainer.strategy), FSDPStrategy)


def test_fsdp_strategy_wraps_each_drafter_layer_and_nothing_of_the_target(tiny_target):
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from draftsmith.drafters.eagle3 import Eagle3Layer

    objective = drafter_for("eagle3", tiny_target)
    cfg = compose_config(["recipe=eagle3", "trainer=fsdp"])
    strategy = build_strategy(cfg.trainer, objective.module)
    assert isinstance(strategy, FSDPStrategy)
    assert strategy.sharding_strategy.name == "FULL_SHARD" and strategy._state_dict_type == "full"
    assert (
        strategy.cpu_offload.offload_params is False and strategy.kwargs["use_orig_params"] is True
    )
    policy = strategy.kwargs["auto_wrap_policy"]
    assert isinstance(policy, ModuleWrapPolicy) and set(policy._module_classes) == {Eagle3Layer}
    # Every drafter parameter is either in a wrapped layer or in the root unit (fc, norm, lm_head);
    # none of the target's parameters is reachable from the module FSDP wraps.
    wrapped = {
        id(p)
        for m in objective.module.modules()
        if isinstance(m, Eagle3Layer)
        for p in m.parameters()
    }
    assert wrapped and len(wrapped) < sum(1 for _ in objective.module.parameters())
    target_ids = {id(p) for p in tiny_target.parameters()}
    assert not target_ids & {id(p) for p in objective.module.parameters()}
    assert strategy._activation_checkpointing_kwargs == {}  # off by default

    on = build_strategy(
        compose_config(
            [
                "recipe=eagle3",
                "trainer=fsdp",
                "trainer.activation_checkpointing=true",
                "trainer.fsdp.cpu_offload=true",
            ]
        ).trainer,
        objective.module,
    )
    check = on._activation_checkpointing_kwargs["auto_wrap_policy"]
    assert set(check._module_classes) == {Eagle3Layer} and on.cpu_offload.offload_params is True


def test_fsdp_wrap_classes_for_medusa_and_by_name(tiny_target):
    from draftsmith.heads.medusa import MedusaHead

    medusa = drafter_for("medusa", tiny_target).module
    assert layer_classes(medusa) == {MedusaHead}
    assert layer_classes(medusa, ["MedusaHead"]) == {MedusaHead}
    with pytest.raises(ConfigError, match="not modules of the drafter; it has: .*MedusaHead"):
        layer_classes(medusa, ["LlamaDecoderLayer"])
    hybrid = build_strategy(
        compose_config(
            [
                "recipe=medusa",
                "trainer=fsdp",
                "trainer.num_nodes=2",
                "trainer.devices=8",
                "trainer.fsdp.sharding_strategy=HYBRID_SHARD",
            ]
        ).trainer,
        medusa,
    )
    assert hybrid.sharding_strategy.name == "HYBRID_SHARD" and hybrid.kwargs["device_mesh"] == (
        2,
        8,
    )
    with pytest.raises(ConfigError, match="state_dict_type='local'; valid: full"):
        build_strategy(
            compose_config(
                ["recipe=medusa", "trainer=fsdp", "trainer.fsdp.state_dict_type=local"]
            ).trainer
        )
    with pytest.raises(ConfigError, match="sharding_strategy='SHARDED'.*FULL_SHARD"):
        build_strategy(
            compose_config(
                ["recipe=medusa", "trainer=fsdp", "trainer.fsdp.sharding_strategy=sharded"]
            ).trainer
        )


def test_fsdp_precision_plugin_is_bf16_mixed():
    from pytorch_lightning.plugins.precision import FSDPPrecision

    plugin = build_precision(compose_config(["recipe=eagle3", "trainer=fsdp"]).trainer)
    assert isinstance(plugin, FSDPPrecision)
    mp = plugin.mixed_precision_config
    assert mp.param_dtype == torch.bfloat16 and mp.reduce_dtype == torch.bfloat16
    assert build_precision(compose_config(["recipe=eagle3", "trainer=cpu"]).trainer) is None


@needs_deepspeed
def test_deepspeed_preset_resolves_to_zero_stage_2():
    from pytorch_lightning.strategies import DeepSpeedStrategy

    cfg = compose_config(["recipe=medusa", "trainer=deepspeed_zero2"])
    strategy = StrategyRegistry.get(cfg.trainer.strategy)
    assert isinstance(strategy, DeepSpeedStrategy)
    assert strategy.config["zero_optimization"]["stage"] == 2


@needs_deepspeed
@pytest.mark.parametrize("preset,stage", [("deepspeed_zero2", 2), ("deepspeed_zero3", 3)])
def test_deepspeed_presets_build_their_zero_stage_and_offload(preset, stage):
    from pytorch_lightning.plugins.precision import DeepSpeedPrecision
    from pytorch_lightning.strategies import DeepSpeedStrategy

    cfg = compose_config(["recipe=eagle3", f"trainer={preset}"])
    strategy = build_strategy(cfg.trainer)
    assert isinstance(strategy, DeepSpeedStrategy)
    zero = strategy.config["zero_optimization"]
    assert (
        zero["stage"] == stage and "offload_optimizer" not in zero and "offload_param" not in zero
    )
    plugin = build_precision(cfg.trainer)
    assert isinstance(plugin, DeepSpeedPrecision) and plugin.precision == "bf16-mixed"
    offload = build_strategy(
        compose_config(
            ["recipe=eagle3", f"trainer={preset}", "trainer.deepspeed.offload_optimizer=true"]
        ).trainer
    )
    assert offload.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    if stage == 3:
        params = build_strategy(
            compose_config(
                ["recipe=eagle3", f"trainer={preset}", "trainer.deepspeed.offload_parameters=true"]
            ).trainer
        )
        assert params.config["zero_optimization"]["offload_param"]["device"] == "cpu"
    else:
        with pytest.raises(
            ConfigError, match="offload_parameters=true needs ZeRO stage 3.*deepspeed_zero3"
        ):
            build_strategy(
                compose_config(
                    [
                        "recipe=eagle3",
                        f"trainer={preset}",
                        "trainer.deepspeed.offload_parameters=true",
                    ]
                ).trainer
            )
