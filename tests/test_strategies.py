"""Every trainer preset composes and shows in ``--cfg job``; DDP builds on CPU, a GPU-only preset on
CPU names the CPU one, target sharding needs a sharding preset, the frozen target stays out of the
state dict and optimizer, activation checkpointing keeps keys, values and gradients, and precision
``auto`` follows the hardware (FSDP and DeepSpeed, checked by construction:
test_sharded_strategies.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from pytorch_lightning.strategies import DDPStrategy

from draftsmith.cli.training import compose_config
from draftsmith.common.errors import ConfigError
from draftsmith.distill.cluster.strategies import (
    apply_activation_checkpointing,
    check_devices,
    resolve_precision,
)
from draftsmith.distill.engine.lightning_trainer import build_trainer
from draftsmith.distill.target.shard import check_target_shard

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ["cpu", "gpu", "ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3"]


@pytest.fixture(scope="module")
def tiny_target(tiny_tokenizer):
    from conftest import build_tiny_llama

    from draftsmith.distill.target.frozen import Target

    return Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")


def drafter_for(recipe: str, target, *overrides: str):
    """The recipe's trainable module for the tiny target (full draft vocabulary: no data scan)."""
    from draftsmith import recipes

    extra = (
        ["drafter.target_layers=[1,2,3]", "drafter.draft_vocab_size=0"]
        if recipe == "eagle3"
        else []
    )
    cfg = compose_config([f"recipe={recipe}", *extra, *overrides])
    return recipes.get_recipe(recipe).build(cfg, target)


@pytest.mark.parametrize("preset", PRESETS)
def test_trainer_presets_compose(preset):
    cfg = compose_config(["recipe=medusa", f"trainer={preset}"])
    assert cfg.trainer.max_steps > 0 and cfg.trainer.strategy
    assert cfg.recipe.name == "medusa"
    assert cfg.trainer.activation_checkpointing is False and cfg.target.shard is False


@pytest.mark.e2e  # a train.py subprocess per preset
@pytest.mark.parametrize(
    "preset,expect",
    [
        (
            "fsdp",
            [
                "strategy: fsdp",
                "sharding_strategy: FULL_SHARD",
                "state_dict_type: full",
                "precision: auto",
            ],
        ),
        ("deepspeed_zero2", ["strategy: deepspeed_stage_2", "offload_optimizer: false"]),
        ("deepspeed_zero3", ["strategy: deepspeed_stage_3", "offload_parameters: false"]),
    ],
)
def test_cfg_job_shows_each_preset(preset, expect):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "recipe=eagle3",
            f"trainer={preset}",
            "target.shard=true",
            "--cfg",
            "job",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for line in [*expect, "activation_checkpointing: false", "shard: true", "keep_checkpoints: 2"]:
        assert line in proc.stdout, (line, proc.stdout)


def test_ddp_preset_builds_a_ddp_trainer_on_cpu(tmp_path):
    cfg = compose_config(["recipe=medusa", "trainer=ddp", "trainer.devices=2"])
    trainer = build_trainer(cfg, tmp_path)
    assert isinstance(trainer.strategy, DDPStrategy) and trainer.num_devices == 2
    assert trainer.strategy.process_group_backend == "gloo"
    # Frozen target weights held as buffers must not be re-broadcast every step.
    assert trainer.strategy._ddp_kwargs.get("broadcast_buffers") is False


@pytest.mark.parametrize("preset", ["fsdp", "deepspeed_zero2", "deepspeed_zero3"])
def test_gpu_only_preset_on_cpu_names_the_cpu_preset(preset):
    cfg = compose_config(["recipe=eagle3", f"trainer={preset}"])
    with pytest.raises(
        ConfigError,
        match=rf"preset trainer={preset.split('_')[0]}.*needs a CUDA GPU.*trainer=cpu"
        r".*trainer=ddp trainer.accelerator=cpu",
    ):
        check_devices(cfg.trainer, cuda_available=False)
    check_devices(cfg.trainer, cuda_available=True)


def test_target_shard_needs_a_sharding_preset():
    def shard(*o):
        return check_target_shard(compose_config(["recipe=eagle3", *o]))

    assert shard("trainer=fsdp") is False  # default: replicated
    assert shard("trainer=fsdp", "target.shard=true") is True
    assert shard("trainer=deepspeed_zero3", "target.shard=true") is True
    for preset in ("ddp", "cpu", "deepspeed_zero2"):
        with pytest.raises(
            ConfigError, match="target.shard=true needs a sharding preset.*trainer=fsdp"
        ):
            shard(f"trainer={preset}", "target.shard=true")


def test_frozen_target_is_never_in_state_dict_or_optimizer(tiny_target):
    from draftsmith.distill.engine.module import DistillModule

    objective = drafter_for("eagle3", tiny_target)
    module = DistillModule(objective, tiny_target, {"lr": 1e-3}, total_steps=4)
    target_ids = {id(p) for p in tiny_target.parameters()}
    optimizer = module.configure_optimizers()["optimizer"]
    optimised = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert optimised == {id(p) for p in objective.module.parameters() if p.requires_grad}
    assert not optimised & target_ids and not {id(p) for p in module.parameters()} & target_ids
    assert all(
        not k.startswith(("_target", "target.")) and ".model.layers." not in k
        for k in module.state_dict()
    )


def test_activation_checkpointing_keeps_keys_values_and_gradients(tiny_target):
    from draftsmith.drafters.eagle3 import Eagle3Layer

    torch.manual_seed(0)
    plain = drafter_for("eagle3", tiny_target)
    torch.manual_seed(0)
    wrapped = drafter_for("eagle3", tiny_target)
    cfg = compose_config(["recipe=eagle3", "trainer=cpu", "trainer.activation_checkpointing=true"])
    assert apply_activation_checkpointing(wrapped.module, cfg.trainer) == {Eagle3Layer}
    assert (
        apply_activation_checkpointing(plain.module, compose_config(["recipe=eagle3"]).trainer)
        == set()
    )
    assert any(type(m).__name__ == "CheckpointWrapper" for m in wrapped.module.modules())
    assert list(plain.module.state_dict()) == list(
        wrapped.module.state_dict()
    )  # export / checkpoint keys unchanged

    ids = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
    }
    feats = tiny_target.features(ids, batch["attention_mask"], plain.taps)
    losses = []
    for objective in (plain, wrapped):
        loss, _ = objective.loss(batch, feats)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1])
    grads = [{n: p.grad for n, p in o.module.named_parameters()} for o in (plain, wrapped)]
    names = [n.replace("_checkpoint_wrapped_module.", "") for n in grads[1]]
    assert names == list(grads[0])
    for (name, g0), g1 in zip(grads[0].items(), grads[1].values()):
        torch.testing.assert_close(g1, g0, msg=name)


def test_wandb_logger_defaults_to_offline():
    cfg = compose_config(["recipe=medusa", "logger=wandb"])
    assert cfg.logger.kind == "wandb" and cfg.logger.mode == "offline"
    assert OmegaConf.select(cfg, "logger.name") is None


@pytest.mark.parametrize(
    "flags,cuda,expect",
    [
        (frozenset({"avx2", "fma", "amx_bf16", "amx_tile"}), None, "bf16-mixed"),  # Intel AMX
        (
            frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
            None,
            "bf16-mixed",
        ),  # Zen 4
        (frozenset({"avx2", "fma"}), None, "32-true"),  # Zen 2/3: bf16 emulated
        (
            frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}),
            None,
            "32-true",
        ),  # AVX-512 without BF16
    ],
)
def test_precision_auto_follows_the_cpu(flags, cuda, expect):
    from draftsmith.kernels.cpu_caps import CpuCaps

    caps = CpuCaps("x86_64", flags, "test CPU", "injected")
    cfg = compose_config(["recipe=eagle3", "trainer=cpu"])
    assert cfg.trainer.precision == "auto"  # the default of every preset
    precision, why = resolve_precision(cfg.trainer, caps=caps, cuda_available=False)
    assert precision == expect and why.startswith(f"auto -> {expect} (") and "CPU" in why
    cfg.trainer.precision = "32-true"
    assert resolve_precision(cfg.trainer, caps=caps) == ("32-true", "32-true (as configured)")


def test_precision_auto_on_gpus_and_in_the_trainer(tmp_path, caplog):
    gpu = compose_config(["recipe=eagle3", "trainer=gpu"]).trainer
    assert resolve_precision(gpu, cuda_available=True, cuda_bf16=True)[0] == "bf16-mixed"
    assert resolve_precision(gpu, cuda_available=True, cuda_bf16=False) == (
        "32-true",
        "auto -> 32-true (this GPU has no bf16 support)",
    )
    # planned here, trained there
    assert resolve_precision(gpu, cuda_available=False)[0] == "bf16-mixed"
    auto = compose_config(["recipe=eagle3", "trainer=cpu", "trainer.accelerator=auto"]).trainer
    assert resolve_precision(auto, cuda_available=True, cuda_bf16=True)[0] == "bf16-mixed"
    import logging

    from draftsmith.distill.engine.lightning_trainer import apply_precision

    cfg = compose_config(["recipe=eagle3", "trainer=cpu"])
    with caplog.at_level(logging.INFO):
        chosen = apply_precision(cfg)
    assert (
        cfg.trainer.precision
        == chosen
        == resolve_precision(compose_config(["recipe=eagle3"]).trainer)[0]
    )
    assert "trainer precision: auto -> " in caplog.text
    assert build_trainer(cfg, tmp_path).precision_plugin.precision == chosen
