"""Triton kernel for :func:`draftsmith.kernels.kv_compact.compact_kv` (imports triton; load lazily).

One program per (layer*kv-head, block of the head dim) copies the n accepted slots in ascending
order. The copy is sequential over slots on purpose: a destination slot may be the source of a later
slot only in the other direction (src[i] > dst_start + i' for every i' < i, since sources are
ascending and >= their destinations), so an ascending loop never reads a slot after overwriting it,
while fully parallel copies could race.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _compact_kernel(
    k_ptr,
    v_ptr,
    src_ptr,
    stride_kl,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vl,
    stride_vh,
    stride_vs,
    stride_vd,
    Hkv,
    D,
    n,
    dst_start,
    BLOCK_D: tl.constexpr,
):
    lh = tl.program_id(0)
    layer = lh // Hkv
    head = lh % Hkv
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_valid = offs_d < D
    k_base = k_ptr + layer * stride_kl + head * stride_kh + offs_d * stride_kd
    v_base = v_ptr + layer * stride_vl + head * stride_vh + offs_d * stride_vd
    for i in range(0, n):
        src = tl.load(src_ptr + i)
        dst = dst_start + i
        kr = tl.load(k_base + src * stride_ks, mask=d_valid)
        tl.store(k_base + dst * stride_ks, kr, mask=d_valid)
        vr = tl.load(v_base + src * stride_vs, mask=d_valid)
        tl.store(v_base + dst * stride_vs, vr, mask=d_valid)


def compact_kv_triton(
    k: torch.Tensor, v: torch.Tensor, src_slots: torch.Tensor, dst_start: int
) -> None:
    """Triton implementation of :func:`draftsmith.kernels.kv_compact.compact_kv` (inputs already
    validated)."""
    n_layers, hkv, _, d = k.shape
    src = src_slots.to(device=k.device, dtype=torch.int64).contiguous()
    block_d = min(128, triton.next_power_of_2(d))
    grid = (n_layers * hkv, triton.cdiv(d, block_d))
    _compact_kernel[grid](
        k,
        v,
        src,
        k.stride(0),
        k.stride(1),
        k.stride(2),
        k.stride(3),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        v.stride(3),
        hkv,
        d,
        src.numel(),
        dst_start,
        BLOCK_D=block_d,
    )
