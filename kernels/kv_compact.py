"""KV-cache compaction: after verification, move the accepted tree nodes' slots next to the
prefix."""

from __future__ import annotations

import torch

from draftsmith.kernels.dispatch import resolve_backend


def _check(k: torch.Tensor, v: torch.Tensor, src_slots: torch.Tensor, dst_start: int) -> None:
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            "compact_kv expects layer-stacked k, v [L, Hkv, S, d]; "
            f"got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if src_slots.dim() != 1 or src_slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"src_slots must be a 1-D integer tensor; got {src_slots.dtype}"
            f" {tuple(src_slots.shape)}"
        )
    n = src_slots.numel()
    if dst_start < 0 or dst_start + n > k.shape[2]:
        raise ValueError(
            f"destination slots {dst_start}..{dst_start + n - 1} exceed the cache length"
            f" {k.shape[2]}"
        )


def compact_kv_torch(
    k: torch.Tensor, v: torch.Tensor, src_slots: torch.Tensor, dst_start: int
) -> None:
    """Plain-PyTorch reference of :func:`compact_kv`."""
    n = src_slots.numel()
    idx = src_slots.to(device=k.device, dtype=torch.long)
    # Gather first (a copy), then write: ascending sources >= destinations would also be safe in
    # place, but a gather-then-scatter is correct for any order.
    k[:, :, dst_start : dst_start + n] = k.index_select(2, idx)  # [L, Hkv, n, d]
    v[:, :, dst_start : dst_start + n] = v.index_select(2, idx)


def compact_kv(
    k: torch.Tensor, v: torch.Tensor, src_slots: torch.Tensor, dst_start: int, backend: str = "auto"
) -> None:
    """In place: for layer-stacked k, v [L, Hkv, S, d] copy slots ``src_slots`` (long [n],
    ascending, each >= dst_start) to ``dst_start .. dst_start+n-1``. ``backend``: "auto" | "torch" |
    "triton"."""
    _check(k, v, src_slots, dst_start)
    if src_slots.numel() == 0:
        resolve_backend(backend, k, v)  # still validate the backend name
        return
    if resolve_backend(backend, k, v) == "triton":
        from draftsmith.kernels._triton_kv_compact import compact_kv_triton

        compact_kv_triton(k, v, src_slots, dst_start)
        return
    compact_kv_torch(k, v, src_slots, dst_start)
