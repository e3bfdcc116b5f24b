"""Losses for online distillation; every function takes a 0/1 ``mask`` [B, T] and averages over
masked positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from draftsmith.common.errors import ConfigError
from draftsmith.distill.losses.acceptance import KINDS as ACCEPTANCE_KINDS
from draftsmith.distill.losses.acceptance import acceptance_loss
from draftsmith.kernels.linear_cross_entropy import LinearCEOutput, linear_cross_entropy


def _masked_mean(per_position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``per_position`` [B, T] over ``mask`` [B, T]; zero (with a graph) when the mask is
    empty."""
    mask = mask.to(per_position.dtype)
    return (per_position * mask).sum() / mask.sum().clamp_min(1.0)


def masked_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Hard-label CE: logits [B, T, V], labels [B, T] long, mask [B, T]. Computed in fp32 over
    masked rows only."""
    keep = mask.bool()
    if not keep.any():
        return logits.sum() * 0.0
    return F.cross_entropy(logits[keep].float(), labels[keep])  # [N, V] -> scalar


def soft_cross_entropy(
    logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """CE against the teacher's distribution softmax(target_logits / T): -sum_v p(v) log q(v),
    masked mean."""
    keep = mask.bool()
    if not keep.any():
        return logits.sum() * 0.0
    p = F.softmax(target_logits[keep].float() / temperature, dim=-1)  # [N, V]
    log_q = F.log_softmax(logits[keep].float() / temperature, dim=-1)  # [N, V]
    return -(p * log_q).sum(-1).mean()


def masked_smooth_l1(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SmoothL1 feature regression: pred/target [B, T, H], mean over H then masked mean over
    positions."""
    per_position = F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(
        -1
    )  # [B, T]
    return _masked_mean(per_position, mask)


def topk_hits(top: torch.Tensor, labels: torch.Tensor, k: int = 1) -> torch.Tensor:
    """Fraction of rows whose label is among the first ``k`` of ``top`` [N, >=k] (sorted top-k ids);
    0 if empty."""
    if top.shape[0] == 0:
        return torch.zeros((), device=top.device)
    return (top[:, :k] == labels.unsqueeze(-1)).any(-1).float().mean()


IGNORE_INDEX = -100  # a hard label that scores nothing (the fused kernel's default ignore_index)


def weighted_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    teacher_logits: torch.Tensor | None,
    row_weight: torch.Tensor | None,
    reduction: str = "mean",
) -> torch.Tensor:
    """CE of ``logits`` [N, V] against hard ``labels`` [N] (IGNORE_INDEX rows score nothing) or
    ``softmax(teacher_logits)`` [N, V], each row weighted by ``row_weight`` [N]; ``mean`` divides by
    the scored weight (a tensor, no read-back), ``sum`` does not. The fused kernel's plain
    reference."""
    log_q = F.log_softmax(logits.float(), dim=-1)  # [N, V]
    weights = (
        torch.ones(logits.shape[0], device=logits.device)
        if row_weight is None
        else row_weight.float()
    )
    if teacher_logits is None:
        valid = labels != IGNORE_INDEX
        per_row = -log_q.gather(-1, labels.clamp_min(0)[:, None])[:, 0]  # [N]
        weights = weights * valid
    else:
        per_row = -(F.softmax(teacher_logits.float(), dim=-1) * log_q).sum(-1)  # [N]
    total = (per_row * weights).sum()
    return (
        total / weights.sum().clamp_min(torch.finfo(torch.float32).tiny)
        if reduction == "mean"
        else total
    )


_LM_HEAD_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class LMHeadLoss:
    """Cross-entropy of a vocabulary-wide head, from its input hidden [N, H] and weight [V, H].

    ``fused`` (config ``loss.fused_linear_ce``: auto | true | false, auto = on) runs
    :func:`draftsmith.kernels.linear_cross_entropy.linear_cross_entropy`: rows in chunks, never the
    [N, V] logits; off computes the logits and uses :func:`masked_cross_entropy` /
    :func:`soft_cross_entropy`. ``matmul_dtype`` (``loss.lm_head_dtype``: auto | fp32 | bf16) is the
    dtype of the head's matmuls; auto (None) follows the trainer precision (autocast) and the
    inputs. Both paths give the same values and gradients. ``acceptance`` (``loss.acceptance``: none
    | hybrid | nla | tv) replaces the cross-entropy with an acceptance-targeted loss
    (:mod:`draftsmith.distill.losses.acceptance`), which also reports the overlap.
    """

    fused: bool = True
    chunk_size: int | None = None
    matmul_dtype: torch.dtype | None = None
    # loss.acceptance: none | hybrid | nla | tv (distill/losses/acceptance.py)
    acceptance: str = "none"
    acceptance_eta: float = 3.0
    # loss.replay_weight: on-policy error-position replay (recipes/eagle3.py)
    replay_weight: float = 0.0

    @classmethod
    def from_config(cls, cfg: Any, replay: bool = False) -> LMHeadLoss:
        """Read the ``loss`` block (absent keys take the defaults); one ConfigError per bad value.
        ``replay``: the recipe can weight rejected positions (``loss.replay_weight``); others refuse
        a weight above 0.
        """
        block = cfg.get("loss") or {}
        raw = block.get("fused_linear_ce", "auto")
        choice = str(raw).lower() if not isinstance(raw, bool) else ("true" if raw else "false")
        if choice not in ("auto", "true", "false"):
            raise ConfigError(f"loss.fused_linear_ce={raw!r}; valid: auto, true, false")
        chunk = block.get("chunk_size")
        if chunk is not None and int(chunk) < 1:
            raise ConfigError(f"loss.chunk_size must be >= 1 or null, got {chunk}")
        dtype = str(block.get("lm_head_dtype", "auto"))
        if dtype not in _LM_HEAD_DTYPES:
            raise ConfigError(f"loss.lm_head_dtype={dtype!r}; valid: {', '.join(_LM_HEAD_DTYPES)}")
        kind = str(block.get("acceptance", "none")).lower()
        if kind not in ACCEPTANCE_KINDS:
            raise ConfigError(f"loss.acceptance={kind!r}; valid: {', '.join(ACCEPTANCE_KINDS)}")
        eta = float(block.get("acceptance_eta", 3.0))
        if not eta > 0:
            raise ConfigError(f"loss.acceptance_eta must be > 0, got {eta}")
        replay_weight = float(block.get("replay_weight", 0.0) or 0.0)
        if not replay_weight >= 0:
            raise ConfigError(f"loss.replay_weight must be >= 0 (0 = off), got {replay_weight}")
        if replay_weight > 0 and not replay:
            name = (cfg.get("recipe") or {}).get("name", "this recipe")
            raise ConfigError(
                f"loss.replay_weight={replay_weight}: only recipe=eagle3 replays rejected positions"
                f" (its TTT chain is the served chain); set loss.replay_weight=0 for {name}"
            )
        return cls(
            choice != "false",
            int(chunk) if chunk is not None else None,
            _LM_HEAD_DTYPES[dtype],
            kind,
            eta,
            replay_weight,
        )

    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        *,
        labels: torch.Tensor | None = None,
        teacher_logits: torch.Tensor | None = None,
        topk: int = 0,
        row_weight: torch.Tensor | None = None,
        reduction: str = "mean",
    ) -> LinearCEOutput:
        """Mean CE over the rows of ``hidden`` against hard ``labels`` [N] or
        ``softmax(teacher_logits)`` [N, V]; ``topk`` > 0 also returns each row's top-k ids (for the
        accuracy metrics) as ``.topk`` [N, k]. ``row_weight`` [N] weighs rows (0/1 weights score a
        subset with static shapes: the mean divides by the weights' sum, kept on the device);
        ``reduction="sum"`` returns the weighted sum instead."""
        topk = min(topk, weight.shape[0])
        # the acceptance-targeted objective replaces the cross-entropy
        if self.acceptance != "none":
            return acceptance_loss(
                hidden,
                weight,
                labels,
                teacher_logits=teacher_logits,
                kind=self.acceptance,
                eta=self.acceptance_eta,
                topk=topk,
                chunk_size=self.chunk_size,
                compute_dtype=self.matmul_dtype,
                row_weight=row_weight,
                reduction=reduction,
            )
        if self.fused:
            return linear_cross_entropy(
                hidden,
                weight,
                labels,
                target_logits=teacher_logits,
                topk=topk,
                chunk_size=self.chunk_size,
                compute_dtype=self.matmul_dtype,
                row_weight=row_weight,
                reduction=reduction,
            )
        return self._unfused(hidden, weight, labels, teacher_logits, topk, row_weight, reduction)

    def _unfused(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor | None,
        teacher_logits: torch.Tensor | None,
        topk: int,
        row_weight: torch.Tensor | None,
        reduction: str,
    ) -> LinearCEOutput:
        """:meth:`__call__` with the whole [N, V] logits in memory
        (``loss.fused_linear_ce=false``)."""
        dtype = self.matmul_dtype or torch.promote_types(hidden.dtype, weight.dtype)
        logits = F.linear(hidden.to(dtype), weight.to(dtype))  # [N, V]
        if row_weight is not None or reduction != "mean":
            loss = weighted_cross_entropy(logits, labels, teacher_logits, row_weight, reduction)
        # rows labelled IGNORE_INDEX score nothing, as in the fused path
        elif teacher_logits is None:
            loss = masked_cross_entropy(logits, labels.clamp_min(0), labels != IGNORE_INDEX)
        else:
            loss = soft_cross_entropy(
                logits, teacher_logits, torch.ones(logits.shape[0], device=logits.device)
            )
        with torch.no_grad():
            top = (
                logits.topk(topk, dim=-1).indices
                if topk
                else logits.new_empty(logits.shape[0], 0, dtype=torch.long)
            )
        return LinearCEOutput(loss, top)
