"""DFlash training blocks: random anchors per sequence, the block inputs, positions, attention mask
and labels.

Alignment (drafters/dflash.py's module docstring). A block anchored at position ``a`` holds ``[x_a,
mask * (B-1)]`` at RoPE positions ``a .. a+B-1`` and sees the target's taps at positions ``0 ..
a-1`` only: ``x_a`` plays the verified (bonus) token, whose own target hidden state does not exist
yet at serve time. Slot ``k`` (1..B-1) is scored against the target's distribution of token ``a+k``,
i.e. its logits at position ``a+k-1`` (the target's own next token, not the data's: what
verification accepts). A slot scores only when ``a+k < T`` and ``a+k`` is an assistant label
(``loss_mask``), and only while every earlier slot of its block scores too (a block's scored slots
are a prefix, as accepted drafts are).

Anchors: positions ``a >= 1`` (at least one context position, as a prompt has at least one token)
whose first label ``a+1`` is an assistant token, ``anchors_per_seq`` of them per sequence, drawn
without replacement; a sequence with fewer candidates gets invalid (unscored) filler anchors. All
blocks of a sequence run in ONE drafter forward over the sequence's context keys: query slots of
block ``j`` see context keys ``< a_j`` (and not padding) plus the keys of their own block
(non-causal), never another block's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Blocks:
    """The blocks of a batch: ``A`` anchors per sequence, ``S`` = block_size slots, ``K = S - 1``
    scored slots."""

    anchors: torch.Tensor  # [B, A] long
    block_ids: torch.Tensor  # [B, A*S] long: x_a then mask ids, per block
    positions: torch.Tensor  # [B, A*S] long: a .. a+S-1 per block
    mask: torch.Tensor  # [B, 1, A*S, T + A*S] bool: context keys then block keys
    scored: torch.Tensor  # [B, A, K] bool: slot k+1 is scored (a prefix per block)
    # [B, A, K] long: a+k (clamped into the sequence), the position slot k+1 predicts
    label_pos: torch.Tensor


def sample_anchors(
    labels: torch.Tensor, attn: torch.Tensor, count: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` anchors per row: labels/attn [B, T] 0/1 -> (anchors [B, A] long, valid [B, A]
    bool)."""
    bsz, seq = attn.shape
    cand = torch.zeros(bsz, seq, dtype=torch.bool, device=attn.device)
    # a in 1..T-2, label a+1 assistant
    cand[:, 1 : seq - 1] = attn[:, 1 : seq - 1].bool() & labels[:, 2:].bool()
    noise = torch.rand(bsz, seq, generator=generator, device="cpu").to(
        attn.device
    )  # [B, T] random order
    score = noise.masked_fill(~cand, -1.0)
    k = min(count, seq)
    top, anchors = score.topk(k, dim=-1)  # [B, k]
    valid = top >= 0
    anchors = torch.where(
        valid, anchors, torch.ones_like(anchors)
    )  # fillers at 1: run, never scored
    if k < count:  # shorter sequences than anchors asked for: pad with invalid fillers
        pad = count - k
        anchors = torch.cat([anchors, anchors.new_ones(bsz, pad)], 1)
        valid = torch.cat([valid, valid.new_zeros(bsz, pad)], 1)
    return anchors, valid


def build_blocks(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attn: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> Blocks:
    """The blocks of ``anchors`` [B, A] (``valid`` [B, A]) over input_ids/labels/attn [B, T]."""
    bsz, seq = input_ids.shape
    num = anchors.shape[1]
    device = input_ids.device
    slots = torch.arange(block_size, device=device)  # [S]
    positions = anchors[:, :, None] + slots  # [B, A, S]
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)  # x_a in slot 0
    # Context keys: t < a_j and not padding; block keys: only the query's own block (block-diagonal,
    # non-causal).
    ctx_vis = (torch.arange(seq, device=device) < anchors[:, :, None]) & attn[
        :, None, :
    ].bool()  # [B, A, T]
    ctx_vis = ctx_vis.repeat_interleave(block_size, dim=1)  # [B, A*S, T]
    own = torch.eye(num, dtype=torch.bool, device=device)
    own = own.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)  # [A*S, A*S]
    mask = torch.cat([ctx_vis, own.expand(bsz, -1, -1)], dim=-1)[:, None]  # [B, 1, A*S, T + A*S]
    label_pos = positions[:, :, 1:]  # [B, A, K]: slot k predicts the token at a+k
    inside = label_pos < seq
    clamped = label_pos.clamp(max=seq - 1)
    real = (labels * attn).bool()  # [B, T]
    ok = inside & real.gather(1, clamped.flatten(1)).view_as(clamped) & valid[:, :, None]
    # a block's scored slots stop at its first unscored one
    scored = ok.long().cumprod(dim=-1).bool()
    return Blocks(anchors, block_ids.flatten(1), positions.flatten(1), mask, scored, clamped)


__all__ = ["Blocks", "build_blocks", "sample_anchors"]
