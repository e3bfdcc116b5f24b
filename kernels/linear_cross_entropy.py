"""Fused, chunked linear + cross-entropy: ``CE(hidden @ weight.T (+ bias), target)`` without the [N,
V] logits.

A vocabulary-wide head (576 x 49152 for SmolLM2) turns N scored rows into an [N, V] fp32 logits
tensor, and the plain path then writes several more of that size (log-softmax, its gradient, row
gathers and scatters of the masked selection). Here rows go through the head ``chunk_size`` at a
time: each chunk's logits live only inside the loop, and the chunk's contribution to the loss and to
the gradients of ``hidden``, ``weight`` and ``bias`` is computed right there.

Gradients in the forward pass, not recomputed in backward: the loss is a scalar, so its gradients
are known up to the one scalar ``grad_output`` as soon as the chunk's softmax is. Computing them in
the forward costs the same three matmuls as the plain path (logits, d hidden, d weight) and keeps
only [N, H] + [V, H] for backward; a recomputing backward would pay a fourth V-wide matmul per chunk
(a third more time) to save memory the training step needs anyway for the weight's gradient. The
price is that the gradients are computed even if ``backward`` is never called (evaluation): pass
inputs that do not require grad (or run under ``torch.no_grad``) to skip them.

Targets: hard ``labels`` [N] (``ignore_index`` rows score nothing) or soft ``target_logits`` [N, V]
(CE against ``softmax(target_logits / T)``, the teacher chunked along with the rows). ``row_weight``
[N] weighs rows; the ``mean`` reduction divides by the total weight of the scored rows, so unit
weights give ``F.cross_entropy``'s mean. ``temperature`` T divides both logits. Matmuls run in
``compute_dtype`` (default: the autocast dtype when autocast is on, else the promoted input dtype;
bf16 matmuls accumulate in fp32 inside the GEMM); softmax, loss and the gradient accumulation across
chunks are fp32. A weight (or bias) with ``requires_grad=False`` gets no gradient and none is
computed. ``topk > 0`` also returns the indices of each row's top-k logits (for accuracy metrics,
which otherwise need the logits).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

REDUCTIONS = ("mean", "sum")


class LinearCEOutput(NamedTuple):
    """``loss`` (scalar fp32, differentiable), ``topk`` ([N, k] long indices, or [N, 0] when not
    asked) and, from the acceptance-targeted losses only, ``overlap``: the mean ``sum_v min(p_v,
    q_v)`` over scored rows (no gradient).
    """

    loss: torch.Tensor
    topk: torch.Tensor
    overlap: torch.Tensor | None = None


def default_chunk_size(vocab: int) -> int:
    """Rows per chunk: about 64 MiB of fp32 logits (341 rows at a 49k vocabulary), at least 64 rows.

    Every chunk streams the whole [V, H] weight three times (logits, d hidden, d weight
    accumulation), so small chunks turn a compute-bound GEMM into a memory-bound one; on a 2-core
    CPU 128-row chunks measured slower than 256-512-row ones.
    """
    return max(64, (16 << 20) // max(vocab, 1))


def _check(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    target_logits: torch.Tensor | None,
    bias: torch.Tensor | None,
    row_weight: torch.Tensor | None,
    reduction: str,
    temperature: float,
    chunk_size: int | None,
    topk: int,
) -> None:
    """One clear message per bad input (shapes, dtypes, options)."""
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            "hidden must be [N, H] and weight [V, H]; "
            f"got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    n, h = hidden.shape
    v = weight.shape[0]
    if weight.shape[1] != h:
        raise ValueError(
            f"weight {tuple(weight.shape)} does not match hidden {tuple(hidden.shape)}: expected"
            f" [V, {h}]"
        )
    if (labels is None) == (target_logits is None):
        raise ValueError(
            "pass exactly one of labels (hard targets [N]) or target_logits (soft targets [N, V])"
        )
    if labels is not None and (labels.shape != (n,) or labels.dtype != torch.long):
        raise ValueError(
            f"labels must be a long tensor of shape [{n}], got {labels.dtype} {tuple(labels.shape)}"
        )
    if target_logits is not None and target_logits.shape != (n, v):
        raise ValueError(
            f"target_logits must be [{n}, {v}] (rows of hidden x rows of weight), got "
            f"{tuple(target_logits.shape)}"
        )
    if bias is not None and bias.shape != (v,):
        raise ValueError(f"bias must be [{v}], got {tuple(bias.shape)}")
    if row_weight is not None and row_weight.shape != (n,):
        raise ValueError(f"row_weight must be [{n}], got {tuple(row_weight.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}; valid: {', '.join(REDUCTIONS)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not 0 <= topk <= v:
        raise ValueError(f"topk must be in 0..{v}, got {topk}")


class _LinearCE(torch.autograd.Function):
    """Loss and (scaled) gradients in one chunked pass; backward only multiplies by
    ``grad_output``."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        labels,
        target_logits,
        row_weight,
        ignore_index,
        temperature,
        reduction,
        chunk_size,
        compute_dtype,
        topk,
        grad_enabled,
    ):
        n, v = hidden.shape[0], weight.shape[0]
        device = hidden.device
        # needs_input_grad ignores torch.no_grad (the caller's grad mode): check both, so evaluation
        # skips them.
        need_h, need_w = (
            grad_enabled and ctx.needs_input_grad[0],
            grad_enabled and ctx.needs_input_grad[1],
        )
        need_b = grad_enabled and bias is not None and ctx.needs_input_grad[2]
        w = weight.to(compute_dtype)  # [V, H]; no copy when already in compute_dtype
        b = bias.float() if bias is not None else None
        rw = torch.ones(n, device=device) if row_weight is None else row_weight.float()  # [N]
        if labels is not None:
            valid = labels != ignore_index  # [N]
            rw = rw * valid
            safe_labels = torch.where(
                valid, labels, torch.zeros_like(labels)
            )  # ignored rows gather column 0
        denom = rw.sum() if reduction == "mean" else torch.ones((), device=device)
        # [N]
        scale = rw / denom.clamp_min(torch.finfo(torch.float32).tiny) if reduction == "mean" else rw
        grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=device) if need_w else None
        grad_b = torch.zeros(v, dtype=torch.float32, device=device) if need_b else None
        loss = torch.zeros((), dtype=torch.float64, device=device)  # fp64: a sum over many rows
        top = torch.empty(n, topk, dtype=torch.long, device=device)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            hc = hidden[start:end].to(compute_dtype)  # [C, H]
            z = (hc @ w.T).float()  # [C, V]: the only logits that ever exist
            if b is not None:
                z += b
            if temperature != 1.0:
                z /= temperature
            if topk:
                top[start:end] = z.topk(topk, dim=-1).indices  # [C, k]
            lse = torch.logsumexp(z, dim=-1)  # [C]
            if labels is not None:
                picked = z.gather(1, safe_labels[start:end, None]).squeeze(1)  # [C]
                p = None
            else:
                p = torch.softmax(target_logits[start:end].float() / temperature, dim=-1)  # [C, V]
                picked = (p * z).sum(-1)  # -sum_v p log q = lse - sum_v p z since sum_v p = 1
            sc = scale[start:end]  # [C]
            loss += (sc * (lse - picked)).sum()
            if not (need_h or need_w or need_b):
                continue
            g = z.sub_(lse[:, None]).exp_()  # [C, V] softmax, in place of the logits
            if p is None:
                rows = torch.arange(end - start, device=device)
                # softmax - onehot (ignored rows are zeroed by sc)
                g[rows, safe_labels[start:end]] -= 1.0
            else:
                g -= p
            g *= (sc / temperature)[:, None]  # d loss / d logits
            if need_b:
                grad_b += g.sum(0)
            gc = g.to(compute_dtype)
            if need_h:
                grad_h[start:end] = gc @ w  # [C, V] @ [V, H] -> [C, H]
            if need_w:
                if compute_dtype == torch.float32:
                    grad_w.addmm_(gc.T, hc)  # [V, C] @ [C, H], accumulated in place
                else:
                    grad_w += (gc.T @ hc).float()  # fp32 accumulation across chunks
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(top)
        return loss.float(), top

    @staticmethod
    def backward(ctx, grad_loss, _grad_top):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        out_h = (grad_h * grad_loss).to(h_dtype) if grad_h is not None else None
        out_w = (grad_w * grad_loss).to(w_dtype) if grad_w is not None else None
        out_b = (grad_b * grad_loss).to(b_dtype) if grad_b is not None else None
        return out_h, out_w, out_b, None, None, None, None, None, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    target_logits: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    row_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    compute_dtype: torch.dtype | None = None,
    topk: int = 0,
) -> LinearCEOutput:
    """Cross-entropy of ``hidden [N, H] @ weight.T [H, V] (+ bias [V])`` against ``labels [N]`` or
    the soft ``target_logits [N, V]``, computed ``chunk_size`` rows at a time (see the module
    docstring).

    Equals ``F.cross_entropy(F.linear(hidden, weight, bias), labels, ignore_index=...)`` (mean over
    scored rows, weighted by ``row_weight``) in value and gradient; an input with no scored rows
    gives a zero loss (with a graph) and zero gradients. Returns ``LinearCEOutput(loss,
    topk_indices)``.
    """
    _check(
        hidden,
        weight,
        labels,
        target_logits,
        bias,
        row_weight,
        reduction,
        temperature,
        chunk_size,
        topk,
    )
    device_type = hidden.device.type
    if compute_dtype is None:
        if torch.is_autocast_enabled(device_type):
            compute_dtype = torch.get_autocast_dtype(device_type)
        else:
            compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    chunk = chunk_size or default_chunk_size(weight.shape[0])
    with torch.autocast(
        device_type, enabled=False
    ):  # the compute dtype is explicit: autocast must not recast
        loss, top = _LinearCE.apply(
            hidden,
            weight,
            bias,
            labels,
            target_logits,
            row_weight,
            ignore_index,
            float(temperature),
            reduction,
            chunk,
            compute_dtype,
            int(topk),
            torch.is_grad_enabled(),
        )
    return LinearCEOutput(loss, top)
