"""Drafters' linears through the fused CPU kernel's packed bf16 GEMM.

Drafters (Medusa heads, EAGLE layers) run in the target's dtype. In bf16 on CPU, ``F.linear`` reads
weights at about half the memory bandwidth, which makes drafting a large share of a speculative
step; the packed GEMM of ``draftsmith.kernels.cpu_layer`` streams them at full bandwidth.
:func:`accelerate_linears` swaps a module's ``nn.Linear`` children for :class:`PackedLinear` when
that kernel can run, and leaves the module alone otherwise.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn


class PackedLinear(nn.Module):
    """Inference-only stand-in for a bf16 ``nn.Linear`` on CPU: same outputs to bf16 rounding,
    packed weights."""

    def __init__(self, linear: nn.Linear, kernel: ModuleType) -> None:
        super().__init__()
        from draftsmith.kernels.cpu_layer import pack_weight

        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", pack_weight(linear.weight.detach()))  # [ceil(N/16), K/2, 32]
        self.register_buffer(
            "bias", None if linear.bias is None else linear.bias.detach().contiguous()
        )
        self._kernel = kernel
        # The original weight stays reachable (shared, not copied) for code that reads ``.weight``
        # (dtype checks).
        self.weight = linear.weight.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()  # [M, K]
        y = self._kernel.linear(rows, self.packed, self.bias, self.out_features)  # [M, N]
        return y.view(*x.shape[:-1], self.out_features)


def accelerate_linears(module: nn.Module) -> int:
    """Replace every bf16 CPU ``nn.Linear`` inside ``module`` (even in_features) by a
    :class:`PackedLinear`, in place, when the fused CPU kernel is available; returns how many were
    replaced (0 when it is not).
    """
    from draftsmith.kernels import cpu_layer

    targets = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
        and child.weight.dtype == torch.bfloat16
        and child.weight.device.type == "cpu"
        and child.in_features % 2 == 0
    ]
    if not targets or cpu_layer.why_unavailable() is not None:
        return 0
    try:
        kernel = cpu_layer.load_cpu_layer()
    except cpu_layer.CpuLayerUnavailable:
        return 0
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, kernel))
    return len(targets)
