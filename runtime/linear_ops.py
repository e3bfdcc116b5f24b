"""How the lean decoder runs its linears: plain tensors, oneDNN-prepacked bf16, or the fused C++ bf16 layer.

``choose_linear_ops`` maps the ``linear_backend`` setting ("auto" | "dense" | "mkldnn" | "cpp") to one of the op sets
below for the model's dtype and device. "auto" takes the fastest that can run: on a CPU with AVX512-BF16 and a bf16
model, the fused C++ layer (``draftsmith.kernels.cpu_layer``, built on first use); else oneDNN-prepacked bf16
linears; else dense.
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F

LINEAR_BACKENDS = ("auto", "dense", "mkldnn", "cpp")


def mkldnn_linear_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN prepacked linears can run: bf16 on CPU with the mkldnn ops present."""
    return (
        dtype == torch.bfloat16
        and device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class DenseOps:
    """Linears with plain tensors (MKL): best for fp32 on CPU and for CUDA."""

    name = "dense"

    pack = pack_head = staticmethod(lambda w: w)
    pack_res = staticmethod(lambda w: w.t())  # addmm wants (in, out)
    linear = staticmethod(F.linear)

    @staticmethod
    def linear_add(x: torch.Tensor, w_t: torch.Tensor, b: torch.Tensor | None, res: torch.Tensor) -> torch.Tensor:
        """res + x @ w_t (+ b), the residual add fused into the GEMM when there is no bias."""
        return torch.addmm(res, x, w_t) if b is None else res + torch.addmm(b, x, w_t)


class MkldnnOps:
    """Linears with oneDNN-prepacked bf16 weights: about 2x faster than F.linear for bf16 GEMV on AVX512-BF16 CPUs."""

    name = "mkldnn"

    pack = staticmethod(lambda w: torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None))
    pack_res = pack_head = pack

    @staticmethod
    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")

    @staticmethod
    def linear_add(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, res: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise.binary(x, res, w, b, "add")


class PackedLinear(NamedTuple):
    """A weight in the fused kernel's packed order plus its true output size (packing pads rows to 16)."""

    packed: torch.Tensor  # [ceil(N/16), K/2, 32] bf16
    out_features: int


def cpp_ops(module: ModuleType) -> type:
    """Op set over the fused C++ extension: weights packed for AVX512-BF16 dot products; layers run whole in C++."""
    from draftsmith.kernels.cpu_layer import pack_weight

    class CppOps:
        name = "cpp"
        pack = staticmethod(pack_weight)
        pack_res = pack
        pack_head = staticmethod(lambda w: PackedLinear(pack_weight(w), w.shape[0]))
        linear = staticmethod(lambda x, w, b: module.linear(x.contiguous(), w.packed, b, w.out_features))
        linear_add = None  # residual adds happen inside the fused layer
        layer = staticmethod(module.decoder_layer)

    return CppOps


def choose_linear_ops(
    backend: str, dtype: torch.dtype, device: torch.device, sizes: tuple[int, int, int], compiled: bool
) -> type:
    """The op set for ``backend`` (see the module docstring). Raises ValueError for an unknown name or a backend that
    cannot run on this dtype / device / CPU (the message says why). ``sizes``: (head_dim, hidden, intermediate)."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}; got {backend!r}")
    if backend == "dense":
        return DenseOps
    mkldnn_ok = mkldnn_linear_available(dtype, device)
    if backend == "mkldnn" and not mkldnn_ok:
        raise ValueError(f"linear_backend='mkldnn' needs bf16 weights on CPU; got {dtype} on {device}")
    if backend in ("cpp", "auto") and mkldnn_ok and not compiled:
        from draftsmith.kernels import cpu_layer  # lazy: only bf16 CPU models ever build it

        reason = cpu_layer.why_unavailable() or cpu_layer.shapes_supported(*sizes)
        if reason is None:
            try:
                return cpp_ops(cpu_layer.load_cpu_layer())
            except cpu_layer.CpuLayerUnavailable as err:
                reason = str(err)
        if backend == "cpp":
            raise ValueError(f"linear_backend='cpp' cannot run: {reason}")
        warnings.warn(f"fused CPU layer unavailable ({reason}); using oneDNN linears", stacklevel=3)
    elif backend == "cpp":
        why = "torch.compile is on" if compiled else f"it needs bf16 weights on CPU; got {dtype} on {device}"
        raise ValueError(f"linear_backend='cpp' cannot run: {why}")
    return MkldnnOps if mkldnn_ok else DenseOps
