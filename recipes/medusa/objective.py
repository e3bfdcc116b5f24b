"""Medusa-1 recipe: K heads on the frozen target's post-norm hidden state, per-head CE with decay
lambda^k."""

from __future__ import annotations

from typing import Any

import torch

from draftsmith.common.constants import STOP_FIXED
from draftsmith.common.trees import TreeCalibration, default_medusa_tree
from draftsmith.distill.data.draft_vocab import count_draft_vocab
from draftsmith.distill.engine.objective import CalibratedObjective
from draftsmith.distill.losses.core import IGNORE_INDEX, LMHeadLoss, topk_hits
from draftsmith.distill.target.frozen import FeatureTaps, Target, TargetFeatures
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
from draftsmith.kernels.linear_cross_entropy import LinearCEOutput
from draftsmith.recipes.lm_loss import lm_head_loss
from draftsmith.recipes.medusa import Medusa
from draftsmith.recipes.medusa2 import Medusa2
from draftsmith.recipes.registration import untyped


class MedusaObjective(CalibratedObjective):
    """Trains ``MedusaHeads``: head k at position t is scored on token t+k+2 (the target head
    predicts t+1)."""

    def __init__(
        self,
        heads: MedusaHeads,
        decay: float,
        labels: str,
        topk: int,
        tree: list[list[int]],
        inference: dict[str, Any],
        lm_loss: LMHeadLoss | None = None,
        tree_nodes: int | None = None,
    ) -> None:
        self.module = heads
        self.decay = decay
        self.labels = labels
        self.topk = topk
        self.tree = tree
        self.inference = inference
        # fused chunked linear + CE by default (loss.fused_linear_ce)
        self.lm_loss = lm_loss or LMHeadLoss()
        # Validation top-k accuracies of each head -> Medusa's greedy optimal tree in the export
        # (``tree`` stays the fallback when no validation ran).
        self.calibration = TreeCalibration(
            heads.config.num_heads, int(inference.get("top_k", 10)), tree_nodes or len(tree), tree
        )
        # Self-distillation needs the target's logits; dataset labels only need the hidden state.
        self.taps = FeatureTaps(final_hidden=True, logits=labels != "dataset")

    def loss(
        self, batch: dict[str, torch.Tensor], feats: TargetFeatures
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sum over heads of decay^(k+1) * CE(head k at t, label at t+k+2), masked by the label
        position's loss mask."""
        # The target may run in bf16 while the heads train in fp32 (or under autocast): match the
        # heads' dtype.
        hidden = feats.final_hidden.to(next(self.module.parameters()).dtype)  # [B, T, H]
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"] * batch["attention_mask"]
        # Self-distillation label for token s is the target's prediction at position s-1.
        greedy = feats.logits.argmax(-1) if self.labels == "target_argmax" else None  # [B, T]
        total = hidden.new_zeros((), dtype=torch.float32)
        metrics: dict[str, torch.Tensor] = {}
        calibrating = not self.module.training and feats.logits is not None
        topk = max(self.topk, self.calibration.stats.top_k) if calibrating else self.topk
        for k in range(self.module.config.num_heads):
            shift = k + 2
            if hidden.shape[1] <= shift:
                break
            h = hidden[:, :-shift]  # [B, T-shift, H]
            mask = loss_mask[
                :, shift:
            ]  # [B, T-shift]: the label position must be an assistant token
            # Only masked rows go through the head's LM head: the V-wide matmul dominates the cost.
            keep = mask.bool()
            rows = h[keep]  # [N, H]
            if self.labels == "dataset":
                labels = input_ids[:, shift:][keep]  # [N]
                out = medusa_head_loss(self.lm_loss, self.module, rows, k, labels=labels, topk=topk)
            elif self.labels == "target_argmax":
                labels = greedy[:, shift - 1 : -1][keep]  # target argmax at s-1 predicts token s
                out = medusa_head_loss(self.lm_loss, self.module, rows, k, labels=labels, topk=topk)
            else:
                teacher = feats.logits[:, shift - 1 : -1][keep]  # [N, V]
                labels = teacher.argmax(-1)
                out = medusa_head_loss(
                    self.lm_loss, self.module, rows, k, teacher=teacher, topk=topk
                )
            head_loss = out.loss
            weight = self.decay ** (k + 1)
            total = total + weight * head_loss
            with torch.no_grad():
                if feats.logits is not None:
                    # Agreement with the target's own greedy choice of token t+k+2 (what greedy
                    # decoding accepts).
                    greedy_labels = feats.logits[:, shift - 1 : -1].argmax(-1)[keep]
                    metrics[f"head{k}/agree_target_top1"] = topk_hits(out.topk, greedy_labels, 1)
                    if calibrating:
                        self.calibration.stats.update_topk(k, out.topk, greedy_labels)
                metrics[f"head{k}/loss"] = head_loss.detach()
                metrics[f"head{k}/top1"] = topk_hits(out.topk, labels, 1)
                metrics[f"head{k}/top{self.topk}"] = topk_hits(out.topk, labels, self.topk)
        return total, metrics

    def export_config(self) -> dict[str, Any]:
        return {
            "method": "medusa",
            "architecture": self.module.architecture(),
            "inference": {**self.inference, **self.calibration.tree_block()},
        }


def medusa_head_loss(
    lm_loss: LMHeadLoss,
    heads: MedusaHeads,
    rows: torch.Tensor,
    k: int,
    *,
    labels: torch.Tensor | None = None,
    teacher: torch.Tensor | None = None,
    topk: int = 0,
) -> LinearCEOutput:
    """CE of head ``k`` on hidden rows [N, H] against target-id ``labels`` [N] or the ``teacher``
    logits [N, V].

    With a draft vocabulary the head scores its V' columns: a label outside it scores nothing (the
    head can never propose it) and the teacher is restricted to it. ``.topk`` comes back as target
    ids, so accuracies and tree calibration count out-of-vocabulary labels as misses."""
    x, weight = heads.head_parts(rows, k)  # [N, H], [V', H]
    if labels is not None:
        labels = heads.to_head_ids(labels, missing=IGNORE_INDEX)  # [N]
    if teacher is not None and heads.draft_ids is not None:
        teacher = teacher[:, heads.draft_ids]  # [N, V']
    out = lm_loss(x, weight, labels=labels, teacher_logits=teacher, topk=topk)
    return LinearCEOutput(out.loss, heads.to_target_ids(out.topk))


def medusa_draft_ids(cfg: Medusa | Medusa2, target: Target) -> torch.Tensor | None:
    """The target ids Medusa heads score (``heads.draft_vocab_size`` most frequent assistant
    tokens), or None."""
    size = cfg.heads.draft_vocab_size
    if not size or size >= target.vocab_size:
        return None
    d2t, _ = count_draft_vocab(
        untyped(cfg), target, size, cfg.heads.vocab_samples, key="heads.draft_vocab_size"
    )
    return d2t + torch.arange(d2t.numel())  # target id = draft index + offset


def default_tree(num_heads: int, num_nodes: int, top_k: int) -> list[list[int]]:
    """The calibration-free sparse Medusa tree: the runtime's one builder
    (:func:`draftsmith.runtime.drafting.tree.default_medusa_tree`), paths sorted by depth then rank
    for the export.
    """
    return sorted(default_medusa_tree(num_heads, num_nodes, top_k), key=lambda p: (len(p), p))


def build(cfg: Medusa, target: Target) -> MedusaObjective:
    """Medusa heads sized from the target, LM heads initialised from (or sharing) the target's."""
    h, inf = cfg.heads, cfg.inference
    draft_ids = medusa_draft_ids(cfg, target)
    arch = MedusaConfig(
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        num_heads=h.num_heads,
        num_layers=h.num_layers,
        share_lm_head=h.share_lm_head,
        draft_vocab_size=None if draft_ids is None else int(draft_ids.numel()),
    )
    heads = MedusaHeads(arch, lm_head_weight=target.lm_head_weight.float(), draft_ids=draft_ids)
    inference = {
        "top_k": inf.top_k,
        "verifier": inf.verifier,
        "typical": {
            "posterior_threshold": inf.posterior_threshold,
            "posterior_alpha": inf.posterior_alpha,
        },
        "stop_policy": {"kind": STOP_FIXED},
    }
    tree = default_tree(arch.num_heads, inf.tree_nodes, inf.top_k)
    return MedusaObjective(
        heads,
        h.decay,
        cfg.distill.labels,
        h.topk_metric,
        tree,
        inference,
        lm_head_loss(cfg.loss),
        tree_nodes=inf.tree_nodes,
    )
