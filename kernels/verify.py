"""Greedy tree verification: the longest drafted prefix that matches the target's argmax, on every
candidate path.

Sampling verification (rejection sampling over a tree) is a short, data-dependent walk over a
handful of nodes; it lives in :mod:`draftsmith.runtime.acceptance.verifiers` in plain torch, where a
kernel would save nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from draftsmith.kernels.dispatch import resolve_backend


class GreedyVerifyResult(NamedTuple):
    """Outcome of :func:`greedy_verify`."""

    best_path: int  # row of ``paths`` with the longest accepted prefix (first one on ties)
    accept_len: int  # drafted tokens accepted on that path (the root is not counted)
    bonus_token: int  # target argmax at the last accepted node
    accept_lens: torch.Tensor  # [P] accepted length of every path
    argmax: torch.Tensor  # [N] target argmax at every node


def target_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dim of ``logits`` [..., V], the first maximum on ties."""
    # bf16 argmax runs ~3x slower than widening to fp32 first on CPU (1.2 vs 0.4 ms for 13 x 49,152
    # logits on Zen 4); widening is exact and argmax returns the first maximum either way, so the
    # result is the same.
    return (logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits).argmax(
        -1
    )


# LM-head rows per chunk of linear_argmax: [T, 8192] fp32 logits stay in L2 on a CPU
HEAD_CHUNK = 8192


def linear_argmax(
    x: torch.Tensor,
    weight: torch.Tensor,
    chunk: int = HEAD_CHUNK,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
) -> torch.Tensor:
    """The greedy LM head for x [T, K] and weight [V, K] without the [T, V] logits: ``chunk`` rows
    of ``weight`` at a time, keeping each row's running maximum and its index. ``linear``: the GEMM
    (tests inject one that rounds as another BLAS does).

    What it guarantees, on every CPU and BLAS: the first maximum of the logits AS THE CHUNKED GEMM
    COMPUTES THEM, ``target_argmax(torch.cat([linear(x, weight[c : c + chunk]) for c in ...], 1))``
    bit for bit (a later chunk replaces the running winner only when strictly greater, or NaN over a
    number, as torch.argmax ranks NaN highest, so ties keep the lowest index). The plain and the
    speculative greedy loops both pick tokens through this one head, so their outputs agree. It is
    NOT guaranteed to be the argmax of the full-width ``F.linear(x, weight)``: a BLAS may round an
    output differently with another number of weight rows (MKL on AVX2 / AVX-512 does not; the AMX
    path of an Intel Xeon does, and there a row and its exact copy in another chunk came out
    unequal). The winner is always a maximum of the full logits up to that rounding; only rows whose
    logits tie within it can trade places.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or chunk < 1:
        raise ValueError(
            f"linear_argmax expects x [T, K], weight [V, K] and chunk >= 1; got {tuple(x.shape)}, "
            f"{tuple(weight.shape)}, chunk={chunk}"
        )
    best_v: torch.Tensor | None = None
    best_i = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)  # [T]
    for v0 in range(0, weight.shape[0], chunk):
        logits = linear(x, weight[v0 : v0 + chunk])  # [T, c]: a row slice is a view
        i = target_argmax(logits)  # [T]
        v = logits.gather(1, i[:, None]).squeeze(1).float()  # [T]
        if best_v is None:
            best_v, best_i = v, i
            continue
        wins = (v > best_v) | (v.isnan() & ~best_v.isnan())  # strict: an equal later column loses
        best_v, best_i = torch.where(wins, v, best_v), torch.where(wins, i + v0, best_i)
    return best_i


def greedy_accept_lengths_torch(
    paths: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: per-node argmax [N] and per-path accepted length [P]."""
    amax = target_argmax(logits)  # [N]
    parent = paths[:, :-1]  # [P, D]
    child = paths[:, 1:]  # [P, D]
    has_child = child >= 0
    match = has_child & (tokens[child.clamp(min=0)] == amax[parent.clamp(min=0)])  # [P, D]
    lens = match.long().cumprod(dim=1).sum(dim=1)  # [P]
    return amax, lens


def greedy_walk(
    paths: list[list[int]], tokens: list[int], argmax: list[int]
) -> tuple[int, int, int]:
    """The same decision as :func:`greedy_verify` in plain Python, for host-side trees:
    ``(best_path, accept_len, bonus_token)`` from paths [P][D+1] (-1 padded), node tokens [N] and
    the target argmax at every node [N].

    On a CPU the trees are a handful of nodes, and a dozen small tensor ops after a verify forward
    cost more (~0.2 ms: cold caches, thread wake-ups) than walking the lists; the argmax itself
    stays one tensor op.
    """
    if not paths or any(not path or path[0] < 0 for path in paths):
        raise ValueError("every path must start at a node (column 0 is the root)")
    best, best_len = 0, -1
    for p, path in enumerate(paths):
        n = 0
        while n + 1 < len(path) and path[n + 1] >= 0 and tokens[path[n + 1]] == argmax[path[n]]:
            n += 1
        if n > best_len:  # strictly longer: the first path wins ties, as lens.argmax() does
            best, best_len = p, n
    return best, best_len, argmax[paths[best][best_len]]


def greedy_verify(
    paths: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor, backend: str = "auto"
) -> GreedyVerifyResult:
    """Greedy verification of a draft tree.

    paths [P, D+1]: node indices of every root->leaf path (column 0 is the root, -1 padded); tokens
    [N]: node tokens; logits [N, V]: target logits at every node (logits at node i predict the token
    after node i). A path accepts the longest prefix with tokens[path[d+1]] ==
    argmax(logits[path[d]]); the best path is the longest (first on ties) and the bonus token is the
    target argmax at its last accepted node.
    """
    if (
        paths.dim() != 2
        or tokens.dim() != 1
        or logits.dim() != 2
        or logits.shape[0] != tokens.shape[0]
    ):
        raise ValueError(
            "greedy_verify expects paths [P, D+1], tokens [N], logits [N, V]; got "
            f"{tuple(paths.shape)}, {tuple(tokens.shape)}, {tuple(logits.shape)}"
        )
    if paths.numel() == 0 or bool((paths[:, 0] < 0).any()):
        raise ValueError("every path must start at a node (column 0 is the root)")
    if resolve_backend(backend, paths, tokens, logits) == "triton":
        from draftsmith.kernels._triton_verify import greedy_accept_lengths_triton

        amax, lens = greedy_accept_lengths_triton(paths, tokens, logits)
    else:
        amax, lens = greedy_accept_lengths_torch(paths.long(), tokens.long(), logits)
    best = int(lens.argmax())  # first maximal index
    acc = int(lens[best])
    last_node = int(paths[best, acc])
    return GreedyVerifyResult(best, acc, int(amax[last_node]), lens, amax)
