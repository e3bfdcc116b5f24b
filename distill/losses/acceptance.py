"""Acceptance-targeted losses for a vocabulary-wide draft head (``loss.acceptance``), after LK
losses (Samarin et al., arXiv 2602.23881): speculative sampling accepts a drafted token with
probability ``alpha = sum_v min(p_v, q_v) = 1 - TV(p, q)`` (p the target's distribution, q the
draft's), which cross-entropy and KL only bound from above.

- ``tv``: ``1 - alpha``, the rejection rate itself (its gradient vanishes while the draft is far
  from the target);
- ``nla``: ``-log alpha`` (the ``1/alpha`` factor keeps the gradient alive early; equals
  cross-entropy against a hard label);
- ``hybrid``: ``lam KL(p || q) + (1 - lam) TV(p, q)`` per row, ``lam = exp(-eta alpha)`` with alpha
  not differentiated: KL's strong gradient while the overlap is small, the acceptance objective once
  it grows (the paper's recommended form, eta = 3).

With hard labels (no teacher logits) p is one-hot: ``alpha = q[label]``. Rows go through the head in
chunks, each recomputed in the backward pass (activation checkpointing), so memory holds one chunk's
[rows, V] logits at a time, as the fused cross-entropy does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from draftsmith.kernels.linear_cross_entropy import LinearCEOutput, default_chunk_size

KINDS = ("none", "hybrid", "nla", "tv")
IGNORE_INDEX = -100
# floor of alpha inside -log alpha (a row the draft gives no mass where the target has it)
_EPS = 1e-6


def row_losses(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    teacher_logits: torch.Tensor | None,
    kind: str,
    eta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss [N] and overlap alpha [N] (no gradient) of draft ``logits`` [N, V] against
    ``teacher_logits`` [N, V] or hard ``labels`` [N] (rows labelled IGNORE_INDEX score 0): the
    reference formulas, unchunked.
    """
    work = torch.promote_types(
        logits.dtype, torch.float32
    )  # bf16 logits in fp32, fp64 (tests) kept
    log_q = F.log_softmax(logits.to(work), dim=-1)  # [N, V]
    if teacher_logits is None:
        valid = labels != IGNORE_INDEX
        log_q_label = log_q.gather(-1, labels.clamp_min(0)[:, None])[:, 0]  # [N]
        alpha = log_q_label.exp()
        kl = -log_q_label  # KL(one-hot || q) = CE
    else:
        valid = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        log_p = F.log_softmax(teacher_logits.to(work), dim=-1)  # [N, V]
        alpha = torch.minimum(log_p.exp(), log_q.exp()).sum(-1)  # [N]
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    if kind == "tv":
        loss = 1.0 - alpha
    elif kind == "nla":
        loss = -alpha.clamp_min(_EPS).log()
    elif kind == "hybrid":
        lam = torch.exp(-eta * alpha.detach())
        loss = lam * kl + (1.0 - lam) * (1.0 - alpha)
    else:
        raise ValueError(f"acceptance loss kind {kind!r}; valid: {', '.join(KINDS[1:])}")
    return loss * valid, alpha.detach() * valid


def acceptance_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    teacher_logits: torch.Tensor | None = None,
    kind: str = "hybrid",
    eta: float = 3.0,
    topk: int = 0,
    chunk_size: int | None = None,
    compute_dtype: torch.dtype | None = None,
    row_weight: torch.Tensor | None = None,
    reduction: str = "mean",
) -> LinearCEOutput:
    """Mean (or ``reduction="sum"``) acceptance-targeted loss of the head ``hidden [N, H] @ weight
    [V, H].T`` over scored rows, each weighted by ``row_weight`` [N] (default 1), chunked (as the
    fused cross-entropy sizes its chunks) and checkpointed: LinearCEOutput(loss, top-k ids [N, k],
    mean overlap alpha over scored rows). The scored weight stays a tensor (no read-back)."""
    if (labels is None) == (teacher_logits is None):
        raise ValueError("acceptance_loss takes either hard labels or teacher logits")
    n, vocab = hidden.shape[0], weight.shape[0]
    dtype = compute_dtype or torch.promote_types(hidden.dtype, weight.dtype)
    rows = chunk_size or default_chunk_size(vocab)
    # zero with a graph to both inputs: a batch with no scored row still backpropagates (DDP expects
    # every parameter)
    total = (hidden.sum() + weight.sum()).to(torch.promote_types(dtype, torch.float32)) * 0.0
    alpha_sum = torch.zeros((), dtype=total.dtype, device=hidden.device)
    tops = []
    for start in range(0, n, rows):
        part, alpha, top = _chunk_sums(
            hidden,
            weight,
            slice(start, start + rows),
            labels,
            teacher_logits,
            row_weight,
            dtype=dtype,
            kind=kind,
            eta=eta,
            topk=topk,
        )
        total, alpha_sum = total + part, alpha_sum + alpha
        tops.append(top)
    # [N]
    weights = torch.ones(n, device=hidden.device) if row_weight is None else row_weight.float()
    if labels is not None:
        weights = weights * (labels != IGNORE_INDEX)
    denom = weights.sum().clamp_min(1.0)  # a tensor: counting the scored rows reads nothing back
    top = torch.cat(tops) if topk and tops else hidden.new_empty(n, 0, dtype=torch.long)
    return LinearCEOutput(total / denom if reduction == "mean" else total, top, alpha_sum / denom)


def _chunk_sums(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: slice,
    labels: torch.Tensor | None,
    teacher_logits: torch.Tensor | None,
    row_weight: torch.Tensor | None,
    *,
    dtype: torch.dtype,
    kind: str,
    eta: float,
    topk: int,
) -> tuple[torch.Tensor, ...]:
    """(weighted loss sum, weighted alpha sum, top-k ids [c, k]) of the chunk ``rows`` of
    :func:`acceptance_loss`'s head; checkpointed when gradients are on, so its [c, V] logits are
    recomputed in backward instead of kept."""
    h = hidden[rows]  # [c, H]
    lab = None if labels is None else labels[rows]
    teach = None if teacher_logits is None else teacher_logits[rows]
    rw = None if row_weight is None else row_weight[rows].float()  # [c]

    def chunk(h_: torch.Tensor, w_: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = F.linear(
            h_.to(dtype), w_.to(dtype)
        )  # [c, V]: this chunk's only, recomputed in backward
        loss, alpha = row_losses(logits, lab, teach, kind, eta)  # [c]
        if rw is not None:
            loss, alpha = loss * rw, alpha * rw
        top = (
            logits.detach().topk(topk, dim=-1).indices
            if topk
            else logits.new_empty(0, dtype=torch.long)
        )
        return loss.sum(), alpha.sum(), top

    if torch.is_grad_enabled():
        return checkpoint(chunk, h, weight, use_reentrant=False)
    return chunk(h, weight)
