"""Tree attention over a static KV cache: the new tokens attend to the whole prefix plus a tree mask
among themselves."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.kernels.dispatch import resolve_backend


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    tree_mask: torch.Tensor | None,
) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"tree_attention expects q [Hq,T,d], k/v [Hkv,S,d]; got {tuple(q.shape)},"
            f" {tuple(k.shape)}"
        )
    hq, t, d = q.shape
    hkv, s, _ = k.shape
    if k.shape != v.shape or k.shape[-1] != d:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must match and share head dim {d} with q"
        )
    if hq % hkv:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) for GQA"
        )
    if prefix_len < 0 or prefix_len + t > s:
        raise ValueError(f"prefix_len {prefix_len} + {t} new tokens exceeds the cache length {s}")
    if tree_mask is not None and (tree_mask.shape != (t, t) or tree_mask.dtype != torch.bool):
        raise ValueError(
            f"tree_mask must be bool [{t}, {t}]; got {tree_mask.dtype} {tuple(tree_mask.shape)}"
        )


def full_mask(
    prefix_len: int, tree_mask: torch.Tensor | None, t: int, device: torch.device
) -> torch.Tensor:
    """Boolean [T, prefix_len+T] mask: every prefix key, then the tree mask (or causal) over the new
    keys."""
    if tree_mask is None:
        tree_mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    prefix = torch.ones(t, prefix_len, dtype=torch.bool, device=device)
    return torch.cat([prefix, tree_mask.to(device)], dim=1)  # [T, P+T]


def window_mask(
    prefix_len: int,
    tree_mask: torch.Tensor | None,
    positions: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """:func:`full_mask` [T, prefix_len+T] with a sliding window on top: query i sees key j only if
    ``positions[i] - pos(j) < window`` (transformers' convention), where prefix slot s holds
    position s and new token j position ``positions[j]`` (a tree node at depth d sits at prefix +
    d). ``window`` None: no window.
    """
    t = positions.numel()
    mask = full_mask(prefix_len, tree_mask, t, positions.device)
    if window is None:
        return mask
    keys = torch.cat([torch.arange(prefix_len, device=positions.device), positions])  # [P+T]
    return mask & (positions[:, None] - keys[None, :] < window)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of T queries q [Hq, T, d] over the first S' = mask.shape[1] slots of k, v [Hkv, S,
    d] under a boolean mask [T, S'] (e.g. :func:`window_mask`); ``softcap`` caps the scaled scores
    to ``softcap * tanh(scores / softcap)`` before masking (Gemma-2), with the softmax in fp32 like
    transformers. Plain PyTorch (any device). Returns [Hq, T, d]."""
    hq, t, d = q.shape
    hkv, s = k.shape[0], mask.shape[1]
    group = hq // hkv
    qg, kk, vv = (
        q.reshape(hkv, group * t, d),
        k[:, :s],
        v[:, :s],
    )  # query heads grouped per kv head (GQA)
    rows = mask.repeat(group, 1)  # [G*T, S']
    if softcap is None:
        out = F.scaled_dot_product_attention(
            qg[None], kk[None], vv[None], attn_mask=rows, scale=scale
        )[0]
    else:
        scores = torch.matmul(qg, kk.transpose(1, 2)) * scale  # [Hkv, G*T, S']
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~rows, float("-inf"))
        out = torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype), vv)
    return out.reshape(hq, t, d)


def tree_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    tree_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Plain-PyTorch reference of :func:`tree_attention` (differentiable)."""
    hq, t, d = q.shape
    hkv = k.shape[0]
    group = hq // hkv
    kk = k[:, : prefix_len + t]  # [Hkv, P+T, d]
    vv = v[:, : prefix_len + t]
    # GQA without materialising repeated K/V: view the query heads as [Hkv, group*T] rows per kv
    # head.
    qg = q.reshape(hkv, group * t, d)  # [Hkv, G*T, d]
    # 4-D inputs keep SDPA on its fused CPU kernel (3-D falls back to the slower math path: ~2x per
    # call).
    if t == 1 and tree_mask is None:
        out = F.scaled_dot_product_attention(
            qg[None], kk[None], vv[None], scale=scale
        )  # one query sees everything
    else:
        mask = full_mask(prefix_len, tree_mask, t, q.device).repeat(group, 1)  # [G*T, P+T]
        out = F.scaled_dot_product_attention(
            qg[None], kk[None], vv[None], attn_mask=mask, scale=scale
        )
    return out[0].reshape(hq, t, d)


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    tree_mask: torch.Tensor | None,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of T new tokens over a static KV cache.

    q [Hq, T, d]: queries of the T new tokens; k, v [Hkv, S, d] with S >= prefix_len + T: the cache
    whose slots prefix_len .. prefix_len+T-1 already hold the new tokens' keys/values. Query i
    attends to every key < prefix_len and to new key j iff tree_mask[i, j] (tree_mask [T, T] bool;
    None = causal j <= i). GQA: Hq is a multiple of Hkv. Returns [Hq, T, d]. ``backend``: "auto" |
    "torch" | "triton" (see :mod:`draftsmith.kernels.dispatch`).
    """
    _check(q, k, v, prefix_len, tree_mask)
    if resolve_backend(backend, q, k, v) == "triton":
        from draftsmith.kernels._triton_attention import tree_attention_triton

        return tree_attention_triton(q, k, v, prefix_len, tree_mask, scale)
    return tree_attention_torch(q, k, v, prefix_len, tree_mask, scale)
