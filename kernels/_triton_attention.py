"""Triton kernel for :func:`draftsmith.kernels.attention.tree_attention` (imports triton; load
lazily).

One program per (query head, block of queries). Keys are visited in blocks with an online softmax:
first the prefix (every key < prefix_len is visible, only the bounds mask applies), then the T new
keys under the tree mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    tm_ptr,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_oh,
    stride_ot,
    stride_od,
    stride_tmi,
    stride_tmj,
    T,
    D,
    prefix_len,
    group,
    sm_scale,
    HAS_TREE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    head = tl.program_id(0)
    kv_head = head // group  # GQA: query heads h*group .. h*group+group-1 share kv head h
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_valid = offs_m < T
    d_valid = offs_d < D

    q = tl.load(
        q_ptr + head * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
        mask=m_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [BM, BD]
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh

    # Finite initial max so fully-masked rows never compute exp(-inf - -inf).
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Prefix keys: all visible.
    for start in range(0, prefix_len, BLOCK_N):
        cols = start + offs_n
        c_valid = cols < prefix_len
        kt = tl.load(
            k_base + cols[None, :] * stride_ks + offs_d[:, None] * stride_kd,
            mask=c_valid[None, :] & d_valid[:, None],
            other=0.0,
        )  # [BD, BN]
        s = tl.dot(q, kt, input_precision=PRECISION) * sm_scale  # [BM, BN]
        s = tl.where(c_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        vb = tl.load(
            v_base + cols[:, None] * stride_vs + offs_d[None, :] * stride_vd,
            mask=c_valid[:, None] & d_valid[None, :],
            other=0.0,
        )  # [BN, BD]
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    # New keys (slots prefix_len .. prefix_len+T-1): tree mask, or causal when there is none.
    for start in range(0, T, BLOCK_N):
        cols = start + offs_n  # index among the new tokens
        c_valid = cols < T
        kt = tl.load(
            k_base + (prefix_len + cols)[None, :] * stride_ks + offs_d[:, None] * stride_kd,
            mask=c_valid[None, :] & d_valid[:, None],
            other=0.0,
        )
        s = tl.dot(q, kt, input_precision=PRECISION) * sm_scale
        if HAS_TREE:
            vis = tl.load(
                tm_ptr + offs_m[:, None] * stride_tmi + cols[None, :] * stride_tmj,
                mask=m_valid[:, None] & c_valid[None, :],
                other=0,
            )
            allowed = (vis != 0) & c_valid[None, :]
        else:
            allowed = (cols[None, :] <= offs_m[:, None]) & c_valid[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        vb = tl.load(
            v_base + (prefix_len + cols)[:, None] * stride_vs + offs_d[None, :] * stride_vd,
            mask=c_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    out = acc / tl.maximum(l_i, 1.0e-30)[:, None]  # a row that sees nothing yields 0, not NaN
    tl.store(
        o_ptr + head * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od,
        out.to(o_ptr.dtype.element_ty),
        mask=m_valid[:, None] & d_valid[None, :],
    )


def tree_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    tree_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Triton implementation of :func:`draftsmith.kernels.attention.tree_attention` (inputs already
    validated)."""
    hq, t, d = q.shape
    group = hq // k.shape[0]
    out = torch.empty_like(q)  # [Hq, T, d]
    block_m = 16  # tl.dot needs >= 16 rows
    block_n = 32
    block_d = max(16, triton.next_power_of_2(d))
    if tree_mask is not None:
        tm = tree_mask.to(device=q.device, dtype=torch.int8).contiguous()  # [T, T]
    else:
        tm = torch.zeros(1, 1, dtype=torch.int8, device=q.device)  # unused placeholder pointer
    # fp32 inputs: exact IEEE products (tf32 would break parity with the reference); 16-bit inputs:
    # tensor cores.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (hq, triton.cdiv(t, block_m))
    _tree_attn_kernel[grid](
        q,
        k,
        v,
        out,
        tm,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        tm.stride(0),
        tm.stride(1),
        t,
        d,
        prefix_len,
        group,
        scale,
        HAS_TREE=tree_mask is not None,
        PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    return out
