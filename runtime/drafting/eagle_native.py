"""The fused CPU kernel behind the EAGLE serving adapters: whether it runs for a drafter (and why
not), the packed weights it reads, and the full mask of a tree step."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from draftsmith.common.layers import build_attention_mask
from draftsmith.runtime.target.fast_linear import accelerate_linears


class HeadWeight:
    """A bare [N, K] weight in the shape :func:`pack_linear` reads (``.weight``, no bias)."""

    bias = None

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight


def draft_kernel(drafter: nn.Module) -> tuple[ModuleType | None, str | None]:
    """(the fused CPU kernel, None) when an EAGLE draft layer can run natively (bf16 on a CPU that
    builds it, shapes it takes), else (None, why)."""
    from draftsmith.kernels import cpu_layer

    w, c = drafter.fc.weight, drafter.config
    if w.dtype != torch.bfloat16 or w.device.type != "cpu":
        return (
            None,
            f"the fused draft layer runs bf16 on CPU; this drafter is {w.dtype} on {w.device.type}",
        )
    why = cpu_layer.why_unavailable() or cpu_layer.shapes_supported(
        c.head_dim, c.hidden_size, c.intermediate_size
    )
    if why is None:
        try:
            return cpu_layer.load_cpu_layer(), None
        except cpu_layer.CpuLayerUnavailable as err:
            why = str(err)
    return None, why


def full_mask(tree_mask: torch.Tensor, seq: int, past: int) -> torch.Tensor:
    """The [S, P+S] bool mask of a tree step (build_attention_mask's, every node seeing itself), in
    3 ops when the caller already gives one over every slot (the proposer does) instead of about
    10."""
    if tuple(tree_mask.shape) != (seq, past + seq) or tree_mask.dtype != torch.bool:
        return build_attention_mask(seq, past, tree_mask.device, tree_mask)[0, 0].contiguous()
    full = tree_mask.clone(
        memory_format=torch.contiguous_format
    )  # never write into the caller's mask
    full[:, past:].diagonal().fill_(True)
    return full


def optional_ln1(kernel: ModuleType) -> str | None:
    """None when the kernel's ``decoder_layer`` takes ``ln1=None`` (a layer without an input norm),
    else why not. pybind lists the arguments positionally: ``ln1`` is the second."""
    sig = (kernel.decoder_layer.__doc__ or "").split("\n")[0]
    ln1 = sig.split(", ")[1] if sig.count(", ") else ""
    if "None" in ln1 or "Optional" in ln1:
        return None
    return (
        "this build of the fused kernel's decoder_layer needs an input norm (ln1); EAGLE-1's layer"
        " has none"
    )


def norm_weight(norm: nn.Module) -> torch.Tensor:
    """A norm's weight as the kernel reads it (detached, contiguous)."""
    return norm.weight.detach().contiguous()


def pack_linear(*parts: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(packed weight [blocks, in/2, 32], bias or None) of one linear (its packing reused when it
    has one: a fast_linear.PackedLinear or the target's packed head), or of several side by side
    (bias-free).
    """
    from draftsmith.kernels.cpu_layer import pack_weight

    bias = getattr(parts[0], "bias", None) if len(parts) == 1 else None
    bias = None if bias is None else bias.detach().contiguous()
    if len(parts) == 1 and getattr(parts[0], "packed", None) is not None:
        return parts[0].packed, bias
    return (
        pack_weight(torch.cat([p.weight.detach() for p in parts])),
        bias,
    )  # [sum of outputs, in] packed


def fused_linear(*parts: nn.Module) -> nn.Module:
    """One bias-free linear whose output is the parts' outputs side by side (one GEMM call instead
    of several), packed for the CPU kernel when it runs here. Reads each part's ``weight`` (a packed
    linear keeps it).
    """
    weight = torch.cat([p.weight.detach() for p in parts])  # [sum of outputs, in]
    fused = nn.Linear(
        weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype
    )
    fused.weight = nn.Parameter(weight, requires_grad=False)
    holder = nn.Sequential(fused)
    accelerate_linears(
        holder
    )  # swaps it for a packed linear where the fused CPU kernel runs (bf16 on x86)
    return holder[0]
