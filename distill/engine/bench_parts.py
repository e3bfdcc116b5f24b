"""``bench-train``'s yardsticks: the machine's measured matmul rate for a dtype, the FLOPs a step
really issues, the host cost of a step whose compute is negligible, and the markdown table.

* :func:`matmul_rate` times a GEMM of the step's own shape (tokens x hidden x intermediate) in the
  step's dtype: the rate every timed part is compared against (``utilization`` = achieved FLOP/s /
  this rate).
* :func:`count_flops` runs a function once under ``torch.utils.flop_counter.FlopCounterMode``: the
  matmul, attention and convolution FLOPs of what actually ran (forward and backward), not a
  formula.
* :func:`count_ops` counts the aten ops a step dispatches (each non-view op is at least one kernel
  launch on a GPU).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "expand",
        "t",
        "transpose",
        "permute",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "as_strided",
        "alias",
        "detach",
        "split",
        "unbind",
        "unflatten",
        "flatten",
    }
)


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queue (CUDA); a no-op on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(
    fn: Callable[[Any], Any], items: list[Any], warmup: int, device: torch.device | str = "cpu"
) -> list[float]:
    """Wall seconds of ``fn(item)`` for each item after the first ``warmup`` (the device drained
    around each)."""
    times = []
    for i, item in enumerate(items):
        synchronize(device)
        start = time.perf_counter()
        fn(item)
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def matmul_rate(
    dtype: torch.dtype, device: torch.device | str, m: int, k: int, n: int, repeats: int = 5
) -> float:
    """Measured FLOP/s of ``[m, k] @ [k, n]`` in ``dtype`` on ``device`` (median of ``repeats``
    after a warm-up)."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    for _ in range(2):
        a @ b
    seconds = statistics.median(timed(lambda _: a @ b, list(range(repeats + 1)), 1, device))
    return 2.0 * m * k * n / max(seconds, 1e-12)


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of one call of ``fn`` (matmuls, attention, convolutions; forward and backward), as
    PyTorch counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


class OpCounter(TorchDispatchMode):
    """Counts dispatched aten ops (``total``) and those that are not views (``launching``: kernels
    on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = self.launching = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        self.launching += func.overloadpacket.__name__.rstrip("_") not in VIEW_OPS
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], Any]) -> dict[str, int]:
    """``{"ops", "launching_ops"}`` of one call of ``fn``."""
    with OpCounter() as counter:
        fn()
    return {"ops": counter.total, "launching_ops": counter.launching}


def utilization(tokens_per_s: float, flops_per_token: float, rate: float) -> float:
    """Achieved FLOP/s over the measured matmul rate."""
    return round(tokens_per_s * flops_per_token / max(rate, 1.0), 4)


def parts_rate(target_tokens_per_s: float, drafter_tokens_per_s: float) -> float:
    """What an online step costs if it is exactly its two parts in sequence: ``1 / (1/target +
    1/drafter-only)``."""
    return 1.0 / (1.0 / max(target_tokens_per_s, 1e-9) + 1.0 / max(drafter_tokens_per_s, 1e-9))


TABLE_ROWS = (
    ("target forward", "target_forward"),
    ("drafter only (cached features)", "drafter_only"),
    ("online step", "train"),
)


def markdown_table(result: dict[str, Any]) -> str:
    """The bench as one markdown table (a row per timed part) and the lines that put them side by
    side."""
    lines = [
        (
            f"bench-train: {result['recipe']}, batch {result['batch']}"
            f" ({result['tokens_per_batch']:,} tokens), precision {result['precision']},"
            f" {result['device']}, {result['threads']} threads"
        ),
        "",
        "| part | tokens/s | ms/step | GFLOP/token | utilization of measured matmul |",
        "|---|---|---|---|---|",
    ]
    for label, key in TABLE_ROWS:
        lines.append(
            f"| {label} | {result[key + '_tokens_per_s']:,.0f} | {result[key + '_ms']:.1f} | "
            f"{result[key + '_gflop_per_token']:.3f} | {result[key + '_utilization']:.1%} |"
        )
    lines += [
        "",
        (
            f"measured matmul rate ({result['matmul_dtype']}, {result['matmul_shape']}): "
            f"{result['matmul_gflops']:,.1f} GFLOP/s"
        ),
        (
            "online step vs its parts (1 / (1/target + 1/drafter-only) ="
            f" {result['parts_tokens_per_s']:,.0f} tokens/s): {result['online_vs_parts']:.1%}"
        ),
    ]
    host = result.get("host")
    if host:
        lines += [
            "",
            "| host cost, compute negligible | ms/step | aten ops/step | launching ops/step |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {row['what']} | {row['ms_per_step']:.1f} | {row['ops']:,} |"
            f" {row['launching_ops']:,} |"
            for row in host
        ]
    return "\n".join(lines)
