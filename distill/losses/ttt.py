"""EAGLE-3's training-time-test (TTT) loss with static shapes and no host-device synchronisation.

Every position of the batch is scored with a 0/1 weight instead of being selected by boolean
indexing (``keep.nonzero()``, ``hidden[keep]``): the shapes of a step never depend on the data,
counts stay tensors on the device, and nothing is read back to the host, so a GPU step can run ahead
of its host, be compiled, or be captured. The values are those of the boolean-indexing formulation
(tests/test_ttt_loss.py checks both on fixed batches).

Alignment (drafters/eagle.py's module docstring, moved ``j`` places on at TTT step ``j``): index
``t`` reads token ``x_{t+1+j}`` and is scored against the target's distribution at position
``t+1+j`` restricted to the draft vocabulary, with weight 1 where ``loss_mask[t+2+j]`` is 1, the
target's greedy token at ``t+1+j`` is in the draft vocabulary and ``t+2+j`` lies in the document of
``t`` (packed rows). ``L = sum_j step_decay^j * softCE_j``, each a weighted mean over its scored
rows.

The teacher is computed once over the draft vocabulary (:meth:`TargetFeatures.draft_logits`: [B, T,
Nd], never a [B, T, V] gather per step). Rows are flattened once: step ``j``'s hidden row ``b*T +
t`` meets teacher row ``b*T + t + 1 + j``, a contiguous view of the same flat teacher (the last ``1
+ j`` rows, which carry no label, are dropped), so no per-step copy of the teacher is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from draftsmith.common.errors import DataError
from draftsmith.distill.losses.core import LMHeadLoss


def shift_left(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x[:, k:]`` right-padded with zeros to ``x``'s length (x [B, T, ...])."""
    return F.pad(x[:, k:], (0, 0) * (x.dim() - 2) + (0, min(k, x.shape[1])))


def document_ids(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, T] document of each position (-1 = padding): the batch's ``document_ids`` (packed rows),
    else one document per row over its attention mask."""
    if "document_ids" in batch:
        return batch["document_ids"]
    return batch["attention_mask"].long() - 1  # 1 -> document 0, 0 -> padding -1


def positions_of(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """[B, T] RoPE positions (packed rows restart them per document), or None for ``0..T-1``."""
    return batch.get("position_ids")


@dataclass
class TTTLoss:
    """The loss, its detached metrics, and the scored / labelled position counts (tensors: never
    read here)."""

    total: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    scored: torch.Tensor | None = None
    labelled: torch.Tensor | None = None


def step_weights(
    labels: torch.Tensor, in_vocab: torch.Tensor, docs: torch.Tensor, j: int
) -> tuple[torch.Tensor, ...]:
    """(weight, wanted) [B, T] of TTT step ``j``: the label at ``t+2+j`` is wanted when it is a loss
    position of the same document; it is scored when the target's greedy token at ``t+1+j`` is also
    draftable.
    """
    same_doc = (shift_left(docs + 1, 2 + j) == docs + 1) & (
        docs >= 0
    )  # shifted padding reads 0 = no document
    wanted = shift_left(labels, 2 + j) * same_doc  # [B, T]
    return wanted * shift_left(in_vocab, 1 + j), wanted


def eagle3_ttt_loss(
    drafter: Any,
    lm_loss: LMHeadLoss,
    batch: dict[str, torch.Tensor],
    feats: Any,
    ttt_steps: int,
    step_decay: float,
    topk: int = 5,
) -> TTTLoss:
    """``sum_j step_decay^j * softCE_j`` of an :class:`~draftsmith.drafters.eagle3.Eagle3Drafter` on
    ``batch`` (``input_ids``, ``attention_mask``, ``loss_mask`` [B, T]; optional ``document_ids`` /
    ``position_ids`` of packed rows) given the target features (``layer_hidden`` of the drafter's
    taps, greedy ids and draft-vocabulary logits), with metrics per step; ``lm_loss.replay_weight``
    adds on-policy replay (:func:`replay_term`).
    """
    ids = batch["input_ids"]
    bsz, length = ids.shape
    if length < 3:  # a shape, known on the host: no read-back
        raise DataError(f"EAGLE-3 needs sequences of at least 3 tokens, got {length}")
    fused_in = torch.cat(
        [feats.layer_hidden[i] for i in drafter.config.target_layers], dim=-1
    )  # [B, T, kH]
    step_tokens = [shift_left(ids, 1 + j) for j in range(ttt_steps)]  # x_{t+1+j}, [B, T] each
    docs = document_ids(batch)
    outputs = drafter.ttt_forward(
        fused_in, step_tokens, positions=positions_of(batch), document_ids=docs
    )
    labels = (batch["loss_mask"] * batch["attention_mask"]).float()  # [B, T]
    in_vocab = drafter.t2d[feats.greedy()].float()  # [B, T]: the target's greedy token is draftable
    teacher = feats.draft_logits(drafter.draft_ids_in_target()).flatten(
        0, 1
    )  # [B*T, Nd], once for every step
    with torch.no_grad():
        teacher_ids = teacher.argmax(
            -1
        )  # [B*T] draft id of the target's argmax (right where the row is scored)
    total = torch.zeros((), dtype=torch.float32, device=ids.device)
    metrics: dict[str, torch.Tensor] = {}
    scored = labelled = torch.zeros((), device=ids.device)
    exposed = torch.ones(
        bsz * length, dtype=torch.bool, device=ids.device
    )  # chains every earlier step got right
    for j, hidden in enumerate(outputs):
        rows = bsz * length - 1 - j  # row r meets teacher row r + 1 + j
        weight, wanted = step_weights(labels, in_vocab, docs, j)
        weight = weight.flatten()[:rows]  # [rows]
        scored, labelled = scored + weight.sum(), labelled + wanted.sum()
        step_loss, exposed, step = ttt_step(
            drafter, lm_loss, hidden, j, weight, teacher, teacher_ids, exposed, topk
        )
        total = total + step_decay**j * step_loss
        metrics.update(step)
    return TTTLoss(total, metrics, scored, labelled)


def ttt_step(
    drafter: Any,
    lm_loss: LMHeadLoss,
    hidden: torch.Tensor,
    j: int,
    weight: torch.Tensor,
    teacher: torch.Tensor,
    teacher_ids: torch.Tensor,
    exposed: torch.Tensor,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """TTT step ``j``'s loss over its scored rows (``weight`` [rows]; row r meets teacher row
    r + 1 + j), with the replay of the rows the served chain would reject there; the chains still
    exposed after it (every earlier step right) and its metrics."""
    rows = weight.shape[0]
    head_in, head_w = drafter.logit_parts(hidden.flatten(0, 1)[:rows])  # [rows, H], [Nd, H]
    out = lm_loss(
        head_in, head_w, teacher_logits=teacher[1 + j :], topk=max(topk, 1), row_weight=weight
    )
    greedy = teacher_ids[1 + j :]  # [rows]
    with torch.no_grad():
        right = (out.topk[:, 0] == greedy) & (
            weight > 0
        )  # the greedy draft token would be accepted
        # where the served chain would stop at this step
        rejected = (weight > 0) & exposed[:rows] & ~right
    step_loss = out.loss
    if lm_loss.replay_weight:
        step_loss = step_loss + replay_term(
            lm_loss, head_in, head_w, teacher[1 + j :], weight, rejected
        )
    exposed = F.pad(
        exposed[:rows] & right, (0, 1 + j)
    )  # a chain that fails here never reaches the target
    return step_loss, exposed, step_metrics(j, step_loss, out, greedy, weight, rejected, topk)


def replay_term(
    lm_loss: LMHeadLoss,
    head_in: torch.Tensor,
    head_w: torch.Tensor,
    teacher: torch.Tensor,
    weight: torch.Tensor,
    rejected: torch.Tensor,
) -> torch.Tensor:
    """On-policy error-position replay (Draft-OPD, arXiv 2605.29343, stateless): ``replay_weight``
    times the loss of the rows verification rejects, over the step's scored count: ``(w / M) sum_{i
    rejected} l_i``. Rows under TTT see exactly the serving loop's context up to their rejection, so
    no rollout is needed to find them.
    """
    extra = lm_loss(
        head_in, head_w, teacher_logits=teacher, row_weight=weight * rejected, reduction="sum"
    ).loss
    return lm_loss.replay_weight * extra / weight.sum().clamp_min(1.0)


def step_metrics(
    j: int,
    step_loss: torch.Tensor,
    out: Any,
    greedy: torch.Tensor,
    weight: torch.Tensor,
    rejected: torch.Tensor,
    topk: int,
) -> dict[str, torch.Tensor]:
    """Detached metrics of TTT step ``j`` as weighted means over its scored rows (0 when none is
    scored)."""
    with torch.no_grad():
        count = weight.sum().clamp_min(1.0)
        hits = out.topk == greedy[:, None]  # [rows, k]
        metrics = {
            f"step{j}/rejected": (rejected.float() * weight).sum() / count,
            f"step{j}/loss": step_loss.detach(),
            f"step{j}/top1": (hits[:, :1].any(-1).float() * weight).sum() / count,
            f"step{j}/top{topk}": (hits[:, :topk].any(-1).float() * weight).sum() / count,
        }
        if out.overlap is not None:  # sum_v min(p, q): the acceptance rate of speculative sampling
            metrics[f"step{j}/overlap"] = out.overlap
    return metrics


def unscored_reason(
    config: Any, scored: torch.Tensor | None, labelled: torch.Tensor | None
) -> str | None:
    """Why a batch scored no position although it has assistant positions (the draft vocabulary
    never holds the target's greedy token), or None. Reads the counts back: call it only to write a
    message."""
    if scored is None or labelled is None or float(scored) != 0 or float(labelled) == 0:
        return None
    return (
        f"the target's greedy token is in the EAGLE-3 draft vocabulary at none of {int(labelled)}"
        f" assistant positions (drafter.draft_vocab_size={config.draft_vocab_size} of"
        f" {config.vocab_size}, counted on the training data): the target does not predict the"
        " data's tokens. Check that target and data match (a random or untrained target?), or"
        " raise drafter.draft_vocab_size (0 = the full vocabulary)"
    )
