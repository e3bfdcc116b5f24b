"""Triton kernels for :func:`draftsmith.kernels.verify.greedy_verify` (imports triton; load lazily).

Two launches: a row-wise argmax over the vocabulary (one program per tree node, looping over
vocabulary blocks), then one program per candidate path that compares each drafted token with its
parent's argmax and counts the matching prefix (the cumulative product of the matches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_argmax_kernel(x_ptr, out_ptr, stride_n, stride_v, V, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_V)
    best_val = tl.full([], float("-inf"), dtype=tl.float32)
    best_idx = tl.full([], 0, dtype=tl.int64)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        x = tl.load(
            x_ptr + row * stride_n + cols * stride_v, mask=cols < V, other=float("-inf")
        ).to(tl.float32)
        blk_val, blk_idx = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        # strict: ties keep the earlier block, i.e. the first maximal index overall
        better = blk_val > best_val
        best_idx = tl.where(better, (start + blk_idx).to(tl.int64), best_idx)
        best_val = tl.where(better, blk_val, best_val)
    tl.store(out_ptr + row, best_idx)


@triton.jit
def _accept_len_kernel(paths_ptr, tokens_ptr, amax_ptr, out_ptr, stride_p, DEPTH):
    path = tl.program_id(0)
    alive = tl.full([], 1, dtype=tl.int64)
    count = tl.full([], 0, dtype=tl.int64)
    for d in range(0, DEPTH):
        parent = tl.load(paths_ptr + path * stride_p + d)
        child = tl.load(paths_ptr + path * stride_p + d + 1)
        has_child = child >= 0
        child_safe = tl.where(has_child, child, 0)
        tok = tl.load(tokens_ptr + child_safe)
        want = tl.load(amax_ptr + tl.where(parent >= 0, parent, 0))
        match = (has_child & (tok == want)).to(tl.int64)
        alive = alive * match  # cumulative product: stays 0 after the first mismatch
        count += alive
    tl.store(out_ptr + path, count)


def greedy_accept_lengths_triton(
    paths: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-node argmax [N] and per-path accepted length [P] (inputs already validated)."""
    n, v = logits.shape
    amax = torch.empty(n, dtype=torch.int64, device=logits.device)
    block_v = min(1024, triton.next_power_of_2(v))
    _row_argmax_kernel[(n,)](logits, amax, logits.stride(0), logits.stride(1), v, BLOCK_V=block_v)
    paths_c = paths.to(torch.int64).contiguous()  # [P, D+1]
    tokens_c = tokens.to(torch.int64).contiguous()  # [N]
    lens = torch.empty(paths_c.shape[0], dtype=torch.int64, device=logits.device)
    _accept_len_kernel[(paths_c.shape[0],)](
        paths_c, tokens_c, amax, lens, paths_c.stride(0), paths_c.shape[1] - 1
    )
    return amax, lens
