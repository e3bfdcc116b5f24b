"""How the lean decoder runs its linears: plain tensors, oneDNN-prepacked bf16, or the fused C++
bf16 layer.

:func:`plan_linear_backend` decides, from the probed CPU capabilities
(``draftsmith.kernels.cpu_caps``), which op set can run and says why; :func:`choose_linear_ops`
builds it. ``"auto"`` never picks what this machine cannot run:

- bf16 on a CPU with AVX512-BF16 or AVX2+FMA (and a C++ compiler): the fused C++ layer, in that
  ISA's variant;
- else bf16 where oneDNN's bf16 linears run (AVX512 BW/VL/DQ or AVX-NE-CONVERT): oneDNN-prepacked
  linears;
- else, and for fp32 and CUDA: plain ``F.linear`` (MKL / cuBLAS).

Forcing ``"cpp"`` or ``"mkldnn"`` where it cannot run raises a ValueError naming the missing
instructions and the backend to use instead.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F

from draftsmith.common.errors import InputError
from draftsmith.kernels import cpu_caps
from draftsmith.kernels.verify import linear_argmax, target_argmax

LINEAR_BACKENDS = ("auto", "dense", "mkldnn", "cpp")


def mkldnn_linear_available(
    dtype: torch.dtype, device: torch.device, caps: cpu_caps.CpuCaps | None = None
) -> bool:
    """Whether oneDNN prepacked bf16 linears can run: bf16 on a CPU whose ISA oneDNN accepts, and a
    trial reorder succeeds (the op existing does not mean this CPU can run it)."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return False
    caps = caps or cpu_caps.probe()
    return caps.onednn_bf16 and cpu_caps.onednn_bf16_runs()


class DenseOps:
    """Linears with plain tensors (MKL): best for fp32 on CPU and for CUDA."""

    name = "dense"

    pack = pack_head = staticmethod(lambda w: w)
    pack_res = staticmethod(lambda w: w.t())  # addmm wants (in, out)
    linear = staticmethod(F.linear)

    @staticmethod
    def argmax(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """Argmax per row of ``x @ w.T`` [T]: chunked over w's rows on a CPU (no [T, V] logits; the
        first maximum of the chunked GEMM's logits, see
        :func:`~draftsmith.kernels.verify.linear_argmax` for what that guarantees), whole on
        CUDA."""
        if b is not None or x.device.type != "cpu":
            return target_argmax(F.linear(x, w, b))
        return linear_argmax(x, w)

    @staticmethod
    def linear_add(
        x: torch.Tensor, w_t: torch.Tensor, b: torch.Tensor | None, res: torch.Tensor
    ) -> torch.Tensor:
        """res + x @ w_t (+ b), the residual add fused into the GEMM when there is no bias."""
        return torch.addmm(res, x, w_t) if b is None else res + torch.addmm(b, x, w_t)


class MkldnnOps:
    """Linears with oneDNN-prepacked bf16 weights: about 2x faster than F.linear for bf16 GEMV on
    AVX512-BF16 CPUs."""

    name = "mkldnn"

    pack = staticmethod(lambda w: torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None))
    pack_res = pack_head = pack

    @staticmethod
    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")

    @staticmethod
    def linear_add(
        x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, res: torch.Tensor
    ) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise.binary(x, res, w, b, "add")

    @classmethod
    def argmax(cls, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """Argmax per row [T] of the whole logits (a prepacked weight cannot be sliced into
        chunks)."""
        return target_argmax(cls.linear(x, w, b))


class PackedLinear(NamedTuple):
    """A weight in the fused kernel's packed order plus its true output size (packing pads rows to
    16)."""

    packed: torch.Tensor  # [ceil(N/16), K/2, 32] bf16
    out_features: int


class StackRunner:
    """The fused C++ ``TargetStack`` of one decoder: its whole forward (every layer, the final norm,
    the LM head) in one native call, and the KV cache it is bound to (rebound when a forward comes
    with another cache's layers).
    """

    def __init__(
        self,
        module: ModuleType,
        layers: list[tuple],
        norm_w: torch.Tensor,
        head: PackedLinear,
        hq: int,
        hkv: int,
        eps: float,
        scale: float,
    ) -> None:
        """``layers``: decoder_layer's 12 weights per layer (the decoder's exec plan, shared, not
        copied)."""
        self.stack = module.TargetStack(
            [list(w) for w in layers], norm_w, head.packed, head.out_features, hq, hkv, eps, scale
        )
        # the cache's per-layer (K, V) list the stack holds, compared by identity
        self.kv_layers: list | None = None

    def __call__(
        self,
        x: torch.Tensor,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        start: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        tree_mask: torch.Tensor | None,
        logits_for: str | torch.Tensor,
        taps: tuple[int, ...],
        head: str,
    ) -> tuple:
        """x [T, H] embeddings -> ``LeanDecoder._run``'s (logits [T', V] | None, hidden [T, H],
        taps, argmax | None)."""
        if kv_layers is not self.kv_layers:
            self.stack.bind_cache([k for k, _ in kv_layers], [v for _, v in kv_layers])
            self.kv_layers = kv_layers
        rows = None if isinstance(logits_for, str) else logits_for.to(torch.long)
        mask = None if tree_mask is None else tree_mask.contiguous()
        out, hidden, found = self.stack.forward(
            x,
            start,
            cos.contiguous(),
            sin.contiguous(),
            mask,
            list(taps),
            head == "argmax",
            rows,
            isinstance(logits_for, str) and logits_for == "last",
        )
        found = dict(zip(taps, found))
        return (None, hidden, found, out) if head == "argmax" else (out, hidden, found, None)


def cpp_ops(module: ModuleType) -> type:
    """Op set over the fused C++ extension (either ISA variant): packed bf16 weights; layers run
    whole in C++."""
    from draftsmith.kernels.cpu_layer import pack_weight

    class CppOps:
        name = "cpp"
        pack = staticmethod(pack_weight)
        pack_res = pack
        pack_head = staticmethod(lambda w: PackedLinear(pack_weight(w), w.shape[0]))
        linear = staticmethod(
            lambda x, w, b: module.linear(x.contiguous(), w.packed, b, w.out_features)
        )
        # The LM head reduced to its argmax per row inside the GEMM: no [T, V] logits are written.
        argmax = staticmethod(
            lambda x, w, b: module.linear_argmax(x.contiguous(), w.packed, b, w.out_features)
        )
        linear_add = None  # residual adds happen inside the fused layer
        layer = staticmethod(module.decoder_layer)
        norm = staticmethod(
            lambda x, w, eps: module.rms_norm(x.contiguous(), w, eps)
        )  # the stack's final norm
        stack = staticmethod(
            partial(StackRunner, module)
        )  # the whole forward in one call (LeanDecoder._run)

    return CppOps


@dataclass(frozen=True)
class LinearPlan:
    """Which op set runs ("cpp" | "mkldnn" | "dense"), the fused layer's ISA variant if cpp, and
    why."""

    kind: str
    reason: str
    isa: str | None = None
    # why "auto" could not take the fused layer (bf16 on CPU only)
    fused_unavailable: str | None = None

    @property
    def label(self) -> str:
        """``cpp:avx2`` style name for logs and bench tables."""
        return f"{self.kind}:{self.isa}" if self.isa else self.kind


def plan_linear_backend(
    backend: str,
    dtype: torch.dtype,
    device: torch.device | str,
    sizes: tuple[int, int, int],
    compiled: bool = False,
    caps: cpu_caps.CpuCaps | None = None,
    mkldnn_ok: bool | None = None,
    toolchain_reason: str | None = None,
    unfused: str | None = None,
) -> LinearPlan:
    """Decide the linear backend without building anything (tests inject ``caps``, ``mkldnn_ok`` and
    ``toolchain_reason``). ``sizes``: (head_dim, hidden, intermediate). ``unfused``: why the fused
    layer cannot run this model's layers (a feature it lacks, e.g. sliding windows), None if it can.
    Raises ValueError for an unknown name or a forced backend that cannot run, naming what is
    missing and what to use instead."""
    from draftsmith.kernels import cpu_layer  # lazy: only its pure checks, nothing is built here

    if backend not in LINEAR_BACKENDS:
        raise InputError(
            f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}; got {backend!r}"
        )
    device = torch.device(device)
    if backend == "dense":
        return LinearPlan("dense", "dense requested")
    if dtype != torch.bfloat16 or device.type != "cpu":
        return _plan_off_bf16_cpu(backend, dtype, device)
    caps = caps or cpu_caps.probe()
    if mkldnn_ok is None:
        mkldnn_ok = mkldnn_linear_available(dtype, device, caps)
    isa, cpp_reason = cpu_layer.pick_isa(caps)
    if isa is not None:
        cpp_reason = unfused or toolchain_reason or cpu_layer.shapes_supported(*sizes)
        if compiled:
            cpp_reason = "torch.compile is on (the fused layer is opaque to it)"
    return _plan_bf16_cpu(backend, caps, isa, cpp_reason, mkldnn_ok)


def _plan_off_bf16_cpu(backend: str, dtype: torch.dtype, device: torch.device) -> LinearPlan:
    """Dense linears (cuBLAS / MKL) for anything but bf16 on CPU; a forced packed backend is
    refused."""
    if backend != "auto":
        raise InputError(
            f"linear_backend={backend!r} cannot run: it needs bf16 weights on CPU; got {dtype}"
            f" on {device}; use linear_backend='dense' (--linear-backend dense)"
        )
    why = (
        "CUDA: cuBLAS"
        if device.type == "cuda"
        else f"{str(dtype).replace('torch.', '')} on {device.type}: MKL"
    )
    return LinearPlan("dense", f"{why} linears")


def _plan_bf16_cpu(
    backend: str,
    caps: cpu_caps.CpuCaps,
    isa: str | None,
    cpp_reason: str | None,
    mkldnn_ok: bool,
) -> LinearPlan:
    """bf16 on CPU: the requested backend when it can run (else a refusal naming what can), or for
    "auto" the fused C++ layer, then oneDNN, then dense. ``isa``: the fused layer's variant for
    this CPU (None: none), ``cpp_reason``: why it cannot run this model (None: it can)."""
    fallback = "mkldnn" if mkldnn_ok else "dense"
    onednn_missing = (
        "oneDNN's bf16 linears need AVX512 BW+VL+DQ or AVX-NE-CONVERT and this CPU has "
        f"{caps.best_isa()}"
    )
    if backend == "cpp":
        if isa is None or cpp_reason:
            raise InputError(
                f"linear_backend='cpp' cannot run: {cpp_reason}; use linear_backend={fallback!r} "
                f"(--linear-backend {fallback})"
            )
        return LinearPlan("cpp", f"fused C++ layer ({isa} variant) requested", isa)
    if backend == "mkldnn":
        if not mkldnn_ok:
            other = "cpp" if isa is not None and not cpp_reason else "dense"
            raise InputError(
                f"linear_backend='mkldnn' cannot run: {onednn_missing}; use"
                f" linear_backend={other!r} (--linear-backend {other})"
            )
        return LinearPlan("mkldnn", "oneDNN bf16 linears requested")
    if isa is not None and not cpp_reason:
        return LinearPlan("cpp", f"fused C++ layer, {isa} variant ({caps.best_isa()} CPU)", isa)
    if mkldnn_ok:
        return LinearPlan(
            "mkldnn",
            f"oneDNN bf16 linears (fused layer unavailable: {cpp_reason})",
            fused_unavailable=cpp_reason,
        )
    return LinearPlan(
        "dense",
        f"plain bf16 F.linear (fused layer unavailable: {cpp_reason}; {onednn_missing})",
        fused_unavailable=cpp_reason,
    )


def choose_linear_ops(
    backend: str,
    dtype: torch.dtype,
    device: torch.device,
    sizes: tuple[int, int, int],
    compiled: bool,
    caps: cpu_caps.CpuCaps | None = None,
    unfused: str | None = None,
) -> tuple[type, LinearPlan]:
    """The op set for ``backend`` and the plan that chose it (see :func:`plan_linear_backend`).
    Under "auto" a fused layer that fails to build falls back to the next choice with a one-line
    warning."""
    toolchain = None
    if (
        backend in ("auto", "cpp")
        and not unfused
        and dtype == torch.bfloat16
        and torch.device(device).type == "cpu"
    ):
        from draftsmith.kernels import cpu_layer

        toolchain = cpu_layer.why_unavailable(caps=caps) if cpu_layer.pick_isa(caps)[0] else None
    plan = plan_linear_backend(
        backend, dtype, device, sizes, compiled, caps, toolchain_reason=toolchain, unfused=unfused
    )
    if plan.kind == "cpp":
        from draftsmith.kernels import cpu_layer

        try:
            return cpp_ops(cpu_layer.load_cpu_layer(plan.isa)), plan
        except cpu_layer.CpuLayerUnavailable as err:
            if backend == "cpp":
                raise InputError(f"linear_backend='cpp' cannot run: {err}") from err
            plan = plan_linear_backend(
                "auto", dtype, device, sizes, compiled, caps, toolchain_reason=str(err)
            )
    if plan.fused_unavailable:
        warnings.warn(f"linear backend: {plan.reason}", stacklevel=3)
    return {"mkldnn": MkldnnOps, "dense": DenseOps}[plan.kind], plan
