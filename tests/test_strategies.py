"""Every trainer preset composes, and GPU-only strategies build the right Lightning strategy objects.

Lightning refuses FSDP and DeepSpeed on a CPU accelerator, so these presets are checked by construction:
the composed config, the strategy object Lightning resolves from it, and its settings.
"""

from __future__ import annotations

import importlib.util

import pytest
from pytorch_lightning.strategies import DDPStrategy, FSDPStrategy, StrategyRegistry

from draftsmith.cli import compose_config
from draftsmith.distill.trainer import build_trainer

PRESETS = ["cpu", "gpu", "ddp", "fsdp", "deepspeed_zero2"]


@pytest.mark.parametrize("preset", PRESETS)
def test_trainer_presets_compose(preset):
    cfg = compose_config(["recipe=medusa", f"trainer={preset}"])
    assert cfg.trainer.max_steps > 0 and cfg.trainer.strategy
    assert cfg.recipe.name == "medusa"


def test_ddp_preset_builds_a_ddp_trainer_on_cpu(tmp_path):
    cfg = compose_config(["recipe=medusa", "trainer=ddp", "trainer.devices=2"])
    trainer = build_trainer(cfg, tmp_path)
    assert isinstance(trainer.strategy, DDPStrategy) and trainer.num_devices == 2
    assert trainer.strategy.process_group_backend == "gloo"
    # Frozen target weights held as buffers must not be re-broadcast every step.
    assert trainer.strategy._ddp_kwargs.get("broadcast_buffers") is False


def test_fsdp_preset_resolves_to_fsdp_strategy():
    cfg = compose_config(["recipe=medusa", "trainer=fsdp"])
    assert cfg.trainer.accelerator == "gpu" and cfg.trainer.precision == "bf16-mixed"
    assert isinstance(StrategyRegistry.get(cfg.trainer.strategy), FSDPStrategy)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed (extra: deepspeed)")
def test_deepspeed_preset_resolves_to_zero_stage_2():
    from pytorch_lightning.strategies import DeepSpeedStrategy

    cfg = compose_config(["recipe=medusa", "trainer=deepspeed_zero2"])
    strategy = StrategyRegistry.get(cfg.trainer.strategy)
    assert isinstance(strategy, DeepSpeedStrategy)
    assert strategy.config["zero_optimization"]["stage"] == 2


def test_wandb_logger_defaults_to_offline():
    cfg = compose_config(["recipe=medusa", "logger=wandb"])
    assert cfg.logger.kind == "wandb" and cfg.logger.mode == "offline"
