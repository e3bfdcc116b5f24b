"""The frozen target replicated on every device, or sharded across them (``target.shard=true``).

The target is never a registered submodule of the LightningModule, so the training strategy never
sees it; it is sharded here with the same engines, after the process group exists and before the
first forward:

* ``trainer=fsdp``: PyTorch FSDP2 (``fully_shard``) on each decoder layer of the target. A layer's
  weights are all-gathered just for its forward and freed after (``reshard_after_forward``), so a
  GPU holds 1/W of the layers plus one gathered layer. No optimizer ever sees them (they are frozen
  and outside the optimised module).
* ``trainer=deepspeed_zero3``: a DeepSpeed ZeRO-3 engine without optimizer over the target (the
  pattern DeepSpeed documents for a frozen teacher / reference model): parameters partitioned,
  gathered per module on forward.

Embeddings and the LM head stay replicated (drafters read them as buffers). ``target.shard=false``
keeps a full bf16 copy per GPU: no gather traffic, the right choice while the target fits next to
the drafter.
"""

from __future__ import annotations

import logging
from typing import Any

import pytorch_lightning as pl
import torch
from omegaconf import DictConfig
from torch import nn

from draftsmith.common.errors import ConfigError
from draftsmith.distill.cluster.strategies import (
    deepspeed_stage,
    resolve_precision,
    strategy_family,
)

log = logging.getLogger(__name__)


def check_target_shard(cfg: DictConfig) -> bool:
    """Whether the target is sharded; a ConfigError when ``target.shard=true`` under a strategy that
    cannot."""
    shard = bool(cfg.target.get("shard", False))
    if not shard:
        return False
    family = strategy_family(cfg.trainer)
    if family == "fsdp" or (family == "deepspeed" and deepspeed_stage(cfg.trainer) == 3):
        return True
    raise ConfigError(
        "target.shard=true needs a sharding preset (trainer=fsdp or trainer=deepspeed_zero3), got "
        f"trainer.strategy={cfg.trainer.strategy}; use target.shard=false to keep one full copy of "
        "the target per device"
    )


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a HF causal LM (``model.model.layers`` or the decoder's ``layers``)."""
    backbone = (
        model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    )
    layers = getattr(backbone, "layers", None)
    if layers is None:
        raise ConfigError(
            f"cannot shard target {type(model).__name__}: no decoder `layers` list found; use "
            "target.shard=false"
        )
    return list(layers)


def shard_with_fsdp(model: nn.Module, mesh: Any | None = None) -> int:
    """``fully_shard`` every decoder layer of ``model`` (frozen) over ``mesh`` (default: all ranks
    on the model's device type). Returns the number of sharded layers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        device = next(model.parameters()).device
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    return len(layers)


def shard_with_deepspeed(model: nn.Module, precision: str) -> nn.Module:
    """A DeepSpeed ZeRO-3 inference engine over the frozen ``model`` (no optimizer); returns the
    engine's module."""
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": "bf16" in precision},
        "fp16": {"enabled": precision.startswith("16")},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine.module


class TargetSharding(pl.Callback):
    """Moves the frozen target to the device and shards it (``target.shard=true``) once the process
    group is up."""

    def __init__(self, target: Any, trainer_cfg: DictConfig) -> None:
        self.target = target
        self.trainer_cfg = trainer_cfg
        self.done = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.done or stage != "fit":
            return
        self.target.to(trainer.strategy.root_device)
        before = sum(p.numel() for p in self.target.model.parameters())
        if strategy_family(self.trainer_cfg) == "fsdp":
            n = shard_with_fsdp(self.target.model)
        else:
            self.target.model = shard_with_deepspeed(
                self.target.model, resolve_precision(self.trainer_cfg)[0]
            )
            n = len(decoder_layers(self.target.model))
        log.info(
            "target sharded over %d ranks: %d decoder layers (%.1fM params frozen, never in"
            " optimizer state)",
            trainer.world_size,
            n,
            before / 1e6,
        )
        self.done = True
