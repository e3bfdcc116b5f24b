"""EAGLE-3's training-time test (TTT) attention: step 0's mask and the merged attention of a later
step over step 0's keys plus its own index's key in each earlier step.

``Eagle3Drafter.ttt_forward`` (drafters/eagle3.py) unrolls the steps; ``Eagle3Layer.ttt_step`` runs
one of them through :func:`ttt_attention`, carrying the keys and values so far in a
:class:`TTTPast`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class TTTPast(NamedTuple):
    """The keys and values [B, nkv, N, d] of the TTT steps so far, step 0 first."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]


def step0_mask(
    n: int,
    device: torch.device,
    pair_mask: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool ``[B|1, 1, N, N]`` (True = attend) of TTT step 0: causal, inside one document
    (``document_ids`` [B, N], -1 = padding), padding keys hidden (``pair_mask`` [B, N]); every query
    sees itself, so no row is empty.
    """
    index = torch.arange(n, device=device)
    mask = (index[None, :] <= index[:, None])[None, None]  # [1, 1, N, N] causal
    if document_ids is not None:
        docs = document_ids.to(device)
        mask = (
            mask
            & (docs[:, None, :, None] == docs[:, None, None, :])
            & (docs >= 0)[:, None, None, :]
        )
    if pair_mask is not None:
        mask = mask & pair_mask.to(device).bool()[:, None, None, :]  # [B, 1, N, N]
    return mask | (index[None, :] == index[:, None])[None, None]


def ttt_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], allowed: torch.Tensor
) -> torch.Tensor:
    """Attention of TTT step ``j = len(keys) - 1``: q [B, nh, N, d] over the step-0 keys ``keys[0]``
    [B, nkv, N, d] where ``allowed`` [B|1, 1, N, N] says so, and over the key of its own index in
    each of ``keys[1:]``.

    One softmax over the N + j scores of a query, merged by hand (log-sum-exp style): the [N, N]
    block of step 0 plus one score per later step, so the mask is built once and never concatenated.
    GQA by broadcasting (no key copies); scores and softmax in fp32, the value products in the value
    dtype. Step 0 alone is plain SDPA.
    """
    bsz, heads, n, dim = q.shape
    groups = heads // keys[0].shape[1]
    if len(keys) == 1:
        return F.scaled_dot_product_attention(
            q, keys[0], values[0], attn_mask=allowed, enable_gqa=groups > 1
        )
    q5 = q.unflatten(1, (-1, groups)).float() * dim**-0.5  # [B, nkv, g, N, d]
    scores = q5 @ keys[0][:, :, None].float().transpose(-1, -2)  # [B, nkv, g, N, N]
    scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))
    own = [
        (q5 * k[:, :, None].float()).sum(-1) for k in keys[1:]
    ]  # j x [B, nkv, g, N]: the diagonal keys
    top = scores.amax(-1)
    for s in own:
        top = torch.maximum(top, s)
    top = top.detach()  # a constant shift: the softmax does not depend on it
    weights0 = (scores - top[..., None]).exp()  # [B, nkv, g, N, N]
    weights = [(s - top).exp() for s in own]  # j x [B, nkv, g, N]
    total = weights0.sum(-1) + sum(weights)  # [B, nkv, g, N]
    out = (weights0.to(values[0].dtype) @ values[0][:, :, None]).float()  # [B, nkv, g, N, d]
    for w, v in zip(weights, values[1:]):
        out = out + w[..., None] * v[:, :, None].float()
    return (out / total[..., None]).to(q.dtype).flatten(1, 2)  # [B, nh, N, d]
