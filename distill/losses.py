"""Losses for online distillation; every function takes a 0/1 ``mask`` [B, T] and averages over masked positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _masked_mean(per_position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``per_position`` [B, T] over ``mask`` [B, T]; zero (with a graph) when the mask is empty."""
    mask = mask.to(per_position.dtype)
    return (per_position * mask).sum() / mask.sum().clamp_min(1.0)


def masked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Hard-label CE: logits [B, T, V], labels [B, T] long, mask [B, T]. Computed in fp32 over masked rows only."""
    keep = mask.bool()
    if not keep.any():
        return logits.sum() * 0.0
    return F.cross_entropy(logits[keep].float(), labels[keep])  # [N, V] -> scalar


def soft_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
    """CE against the teacher's distribution softmax(target_logits / T): -sum_v p(v) log q(v), masked mean."""
    keep = mask.bool()
    if not keep.any():
        return logits.sum() * 0.0
    p = F.softmax(target_logits[keep].float() / temperature, dim=-1)  # [N, V]
    log_q = F.log_softmax(logits[keep].float() / temperature, dim=-1)  # [N, V]
    return -(p * log_q).sum(-1).mean()


def kl_divergence(logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor,
                  temperature: float = 1.0) -> torch.Tensor:
    """KL(p_teacher || q_student) over masked positions (soft CE minus the teacher entropy)."""
    keep = mask.bool()
    if not keep.any():
        return logits.sum() * 0.0
    log_p = F.log_softmax(target_logits[keep].float() / temperature, dim=-1)  # [N, V]
    log_q = F.log_softmax(logits[keep].float() / temperature, dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")


def masked_smooth_l1(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SmoothL1 feature regression: pred/target [B, T, H], mean over H then masked mean over positions."""
    per_position = F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1)  # [B, T]
    return _masked_mean(per_position, mask)


def topk_accuracy(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, k: int = 1) -> torch.Tensor:
    """Fraction of masked positions whose label is among the top-k logits."""
    keep = mask.bool()
    if not keep.any():
        return torch.zeros((), device=logits.device)
    top = logits[keep].topk(k, dim=-1).indices  # [N, k]
    return (top == labels[keep].unsqueeze(-1)).any(-1).float().mean()
