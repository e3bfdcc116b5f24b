"""The lean decoder's layers in PyTorch ops: the plain Llama layer (the reference of the fused C++
layer) and the general layer of the families beyond it (sliding windows, Gemma's sandwich norms,
softcapped attention, GELU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from draftsmith.kernels.attention import masked_attention, tree_attention

Tensor = torch.Tensor


def qk_rope_v(
    linear: Callable,
    x: Tensor,
    ln1: Tensor,
    wqkv: Tensor,
    bqkv: Tensor | None,
    qn: Tensor | None,
    kn: Tensor | None,
    cos: Tensor,
    sin: Tensor,
    hq: int,
    hkv: int,
    d: int,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """A Llama layer's attention inputs for T rows x [T, H]: (q and k after the optional Qwen3 q/k
    norm and RoPE [T, Hq+Hkv, d], v [T, Hkv, d]). Shared by the layer below and the rows step (one
    token per row, ``runtime.target.rows``)."""
    t, nq, nqk = x.shape[0], hq * d, (hq + hkv) * d
    qkv = linear(F.rms_norm(x, x.shape[1:], ln1, eps), wqkv, bqkv)  # [T, (Hq+2Hkv)d]
    if qn is not None:  # Qwen3: per-head RMSNorm of q and k before RoPE
        q = F.rms_norm(qkv[:, :nq].view(t, hq, d), (d,), qn, eps)
        k = F.rms_norm(qkv[:, nq:nqk].view(t, hkv, d), (d,), kn, eps)
        qk = torch.cat((q, k), 1)  # [T, Hq+Hkv, d]
    else:
        qk = qkv[:, :nqk].view(t, hq + hkv, d)  # [T, Hq+Hkv, d]
    qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)  # RoPE on q and k at once
    return qk, qkv[:, nqk:].view(t, hkv, d)


def llama_layer(
    linear: Callable,
    linear_add: Callable,
    kernel_backend: str,
    x: Tensor,
    ln1: Tensor,
    wqkv: Tensor,
    bqkv: Tensor | None,
    qn: Tensor | None,
    kn: Tensor | None,
    wo: Tensor,
    bo: Tensor | None,
    ln2: Tensor,
    wgu: Tensor,
    bgu: Tensor | None,
    wdown: Tensor,
    bdown: Tensor | None,
    kc: Tensor,
    vc: Tensor,
    start: int,
    cos: Tensor,
    sin: Tensor,
    tree_mask: Tensor | None,
    hq: int,
    hkv: int,
    eps: float,
    scale: float,
) -> Tensor:
    """One Llama decoder layer: x [T, H] -> [T, H]; writes K/V at slots start..start+T-1. After its
    first three arguments (bound once at load), the reference of the fused C++ layer (same
    arguments)."""
    t, d = x.shape[0], kc.shape[-1]
    nq = hq * d
    qk, v = qk_rope_v(
        linear, x, ln1, wqkv, bqkv, qn, kn, cos, sin, hq, hkv, d, eps
    )  # [T, Hq+Hkv, d], [T, Hkv, d]
    kc[:, start : start + t] = qk[:, hq:].transpose(0, 1)  # [Hkv, T, d]
    vc[:, start : start + t] = v.transpose(0, 1)
    attn = tree_attention(
        qk[:, :hq].transpose(0, 1), kc, vc, start, tree_mask, scale, kernel_backend
    )
    x = linear_add(attn.transpose(0, 1).reshape(t, nq), wo, bo, x)  # [Hq, T, d] -> [T, H]
    return mlp_residual(linear, linear_add, x, ln2, wgu, bgu, wdown, bdown, eps)  # [T, H]


def mlp_residual(
    linear: Callable,
    linear_add: Callable,
    x: Tensor,
    ln2: Tensor,
    wgu: Tensor,
    bgu: Tensor | None,
    wdown: Tensor,
    bdown: Tensor | None,
    eps: float,
) -> Tensor:
    """A Llama layer's second half: x + down(silu(gate) * up) of the normed x [T, H] -> [T, H].
    Shared by the layer above and the rows step (one token per row, ``runtime.target.rows``)."""
    gu = linear(F.rms_norm(x, x.shape[1:], ln2, eps), wgu, bgu)  # [T, 2I]
    inter = gu.shape[1] // 2
    return linear_add(F.silu(gu[:, :inter]) * gu[:, inter:], wdown, bdown, x)  # [T, H]


def last_dim_rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """``F.rms_norm`` over the last dimension in the (x, w, eps) form of the C++ kernel's
    ``rms_norm``."""
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def gemma_rms_norm(x: Tensor, shape: tuple[int, ...], weight: Tensor, eps: float) -> Tensor:
    """Gemma's RMSNorm: normalise and scale in fp32, then cast (``weight`` already holds ``1 +
    w``)."""
    return F.rms_norm(x.float(), shape, weight.float(), eps).to(x.dtype)


def gelu_tanh(x: Tensor) -> Tensor:
    """transformers' ``gelu_pytorch_tanh``."""
    return F.gelu(x, approximate="tanh")


class LayerSpec(NamedTuple):
    """What the general layer needs besides weights and cache, fixed at load."""

    linear: Callable  # (x, w, b) -> x @ w.T + b in the chosen linear backend
    norm: Callable  # F.rms_norm or gemma_rms_norm
    act: Callable  # F.silu or gelu_tanh
    kernel_backend: str
    hq: int
    hkv: int
    eps: float
    scale: float
    softcap: float | None  # attention logit softcap (Gemma-2)


def family_layer(
    spec: LayerSpec,
    x: Tensor,
    ln1: Tensor,
    wqkv: Tensor,
    bqkv: Tensor | None,
    qn: Tensor | None,
    kn: Tensor | None,
    wo: Tensor,
    bo: Tensor | None,
    post_attn: Tensor | None,
    ln2: Tensor,
    wgu: Tensor,
    bgu: Tensor | None,
    wdown: Tensor,
    bdown: Tensor | None,
    post_ff: Tensor | None,
    kc: Tensor,
    vc: Tensor,
    start: int,
    cos: Tensor,
    sin: Tensor,
    mask: Tensor | None,
    tree_mask: Tensor | None,
) -> Tensor:
    """One decoder layer of any family the lean decoder serves: x [T, H] -> [T, H], K/V written at
    slots start..start+T-1. ``mask`` [T, start+T] (window and tree, see
    ``kernels.attention.window_mask``) or None for a global layer without softcap, which then
    attends through ``tree_attention`` with ``tree_mask``.
    """
    linear, norm, eps, hq, hkv = spec.linear, spec.norm, spec.eps, spec.hq, spec.hkv
    t, d = x.shape[0], kc.shape[-1]
    nq, nqk, hshape = hq * d, (hq + hkv) * d, x.shape[1:]
    qkv = linear(norm(x, hshape, ln1, eps), wqkv, bqkv)  # [T, (Hq+2Hkv)d]
    if qn is not None:  # Qwen3 / Gemma-3: per-head norm of q and k before RoPE
        q = norm(qkv[:, :nq].view(t, hq, d), (d,), qn, eps)
        k = norm(qkv[:, nq:nqk].view(t, hkv, d), (d,), kn, eps)
        qk = torch.cat((q, k), 1)  # [T, Hq+Hkv, d]
    else:
        qk = qkv[:, :nqk].view(t, hq + hkv, d)
    qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)  # RoPE on q and k at once
    kc[:, start : start + t] = qk[:, hq:].transpose(0, 1)  # [Hkv, T, d]
    vc[:, start : start + t] = qkv[:, nqk:].view(t, hkv, d).transpose(0, 1)
    q = qk[:, :hq].transpose(0, 1)  # [Hq, T, d]
    if mask is None:
        attn = tree_attention(q, kc, vc, start, tree_mask, spec.scale, spec.kernel_backend)
    else:
        attn = masked_attention(q, kc, vc, mask, spec.scale, spec.softcap)
    out = linear(attn.transpose(0, 1).reshape(t, nq), wo, bo)  # [T, H]
    x = x + (out if post_attn is None else norm(out, hshape, post_attn, eps))
    gu = linear(norm(x, hshape, ln2, eps), wgu, bgu)  # [T, 2I]
    inter = gu.shape[1] // 2
    out = linear(spec.act(gu[:, :inter]) * gu[:, inter:], wdown, bdown)  # [T, H]
    return x + (out if post_ff is None else norm(out, hshape, post_ff, eps))
