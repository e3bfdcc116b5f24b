"""DeepSpeed ZeRO-3 after ``fit``: put the drafter's buffers and whole parameters back on the
device."""

from __future__ import annotations

import pytorch_lightning as pl
import torch


def move_parameter(param: torch.nn.Parameter, device: torch.device) -> None:
    """Move ``param`` to ``device`` in place, keeping its identity and attributes (the optimizer and
    DeepSpeed's ``ds_*`` bookkeeping refer to the object). ``param.data = ...`` is how ``Module.to``
    moves parameters between CPU and CUDA; where the tensor types differ (e.g. to "meta") the
    contents are swapped and the attributes kept.
    """
    moved = param.data.to(device)
    if torch._has_compatible_shallow_copy_type(param.data, moved):
        param.data = moved
        return
    attributes = dict(param.__dict__)
    torch.utils.swap_tensors(param, torch.nn.Parameter(moved, requires_grad=param.requires_grad))
    param.__dict__.update(attributes)  # swap_tensors swaps __dict__ too


class ZeroThreeDevices(pl.Callback):
    """A ``trainer.validate`` after ``fit`` under DeepSpeed ZeRO-3 (seen on an H100) gets the
    drafter back with its buffers (the frozen target embedding) and its unpartitioned parameters
    still on the CPU, where fit's teardown (``lightning_module.cpu()``) left them. ZeRO-3 gathers
    partitioned parameters onto the GPU itself, but the small ones it keeps whole (``ds_persist``:
    norm weights, below its persistence threshold) and the buffers nothing moves back. Put those on
    the device the batches are on (other parameters are the strategy's)."""

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = trainer.strategy.root_device
        for module in pl_module.drafter.modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.device != device:
                    setattr(module, name, buffer.to(device))
            for param in module.parameters(recurse=False):
                # Only ZeRO-3's whole parameters: a partitioned one holds a placeholder ZeRO-3
                # fills, and a parameter on the CPU under another strategy (FSDP's cpu_offload) is
                # there on purpose.
                if getattr(param, "ds_persist", False) and param.device != device:
                    move_parameter(param, device)
