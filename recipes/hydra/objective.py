"""Hydra and Hydra++ recipes: grounded heads on the frozen target, teacher-forced on the real next
tokens.

Head k at position t reads ``h_t`` and ``x_{t+1} .. x_{t+k+1}`` and is scored on ``x_{t+k+2}``
(``loss_mask`` at that position). ``distill.labels`` picks the label: the dataset token, the
target's greedy token, or (Hydra++'s "teacher loss") the target's distribution at position
``t+k+1``. Per-head weight ``decay^(k+1)`` (the paper sums heads unweighted: ``decay: 1.0``). At
every validation pass the heads' per-rank agreement with the target's greedy tokens is counted; the
export's tree is Medusa's greedy optimal tree on those accuracies (calibration-free fallback when
nothing was counted).
"""

from __future__ import annotations

from typing import Any

import torch

from draftsmith.common.constants import STOP_FIXED
from draftsmith.common.trees import TreeCalibration
from draftsmith.distill.engine.objective import CalibratedObjective
from draftsmith.distill.losses.core import LMHeadLoss, topk_hits
from draftsmith.distill.target.frozen import FeatureTaps, Target, TargetFeatures
from draftsmith.drafters.eagle import EagleConfig
from draftsmith.heads.hydra import HydraConfig, HydraHeads
from draftsmith.recipes.groups import TreeInferenceConfig
from draftsmith.recipes.hydra import Hydra
from draftsmith.recipes.medusa.objective import default_tree


class HydraObjective(CalibratedObjective):
    """Trains :class:`HydraHeads`; ``method`` is ``hydra`` or ``hydra_pp`` (the runtime treats both
    alike)."""

    def __init__(
        self,
        heads: HydraHeads,
        method: str,
        decay: float,
        labels: str,
        topk: int,
        calibration: TreeCalibration,
        inference: dict[str, Any],
        lm_loss: LMHeadLoss | None = None,
    ) -> None:
        self.module = heads
        self.method, self.decay, self.labels, self.topk = method, decay, labels, topk
        self.calibration, self.inference = calibration, inference
        # fused chunked linear + CE (loss.fused_linear_ce): no [N, V] logits
        self.lm_loss = lm_loss or LMHeadLoss()
        self.taps = FeatureTaps(final_hidden=True, logits=labels != "dataset")

    def loss(
        self, batch: dict[str, torch.Tensor], feats: TargetFeatures
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sum over heads of decay^(k+1) * CE(head k at t, label x_{t+k+2}) over assistant label
        positions."""
        ids = batch["input_ids"]
        mask_all = batch["loss_mask"] * batch["attention_mask"]  # [B, T]
        dtype = next(self.module.parameters()).dtype
        ctx, _ = self.module.context(
            feats.final_hidden.to(dtype), batch["attention_mask"]
        )  # [B, T, H]
        total = ctx.new_zeros((), dtype=torch.float32)
        metrics: dict[str, torch.Tensor] = {}
        calibrating = not self.module.training and feats.logits is not None
        topk = max(self.topk, self.calibration.stats.top_k) if calibrating else self.topk
        for k in range(self.module.config.num_heads):
            shift = k + 2
            if ids.shape[1] <= shift:
                break
            keep = mask_all[:, shift:].bool()  # [B, T-shift]: label x_{t+k+2} is an assistant token
            x, weight = self.module.teacher_forced_parts(
                ctx, ids, k, keep
            )  # [N, H(+1)], [V, H(+1)]
            # [N, V]
            teacher = feats.logits[:, shift - 1 : -1][keep] if feats.logits is not None else None
            if self.labels == "target_soft":
                labels = teacher.argmax(-1)
                out = self.lm_loss(x, weight, teacher_logits=teacher, topk=topk)
            else:
                labels = ids[:, shift:][keep] if self.labels == "dataset" else teacher.argmax(-1)
                out = self.lm_loss(x, weight, labels=labels, topk=topk)
            total = total + self.decay ** (k + 1) * out.loss
            with torch.no_grad():
                if teacher is not None:
                    greedy = teacher.argmax(-1)
                    metrics[f"head{k}/agree_target_top1"] = topk_hits(out.topk, greedy, 1)
                    if calibrating:
                        self.calibration.stats.update_topk(k, out.topk, greedy)
                metrics[f"head{k}/loss"] = out.loss.detach()
                metrics[f"head{k}/top1"] = topk_hits(out.topk, labels, 1)
                metrics[f"head{k}/top{self.topk}"] = topk_hits(out.topk, labels, self.topk)
        return total, metrics

    def export_config(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "architecture": self.module.architecture(),
            "inference": {
                "proposer": self.method,
                **self.inference,
                **self.calibration.tree_block(),
            },
        }


def inference_block(inference: TreeInferenceConfig) -> dict[str, Any]:
    """Runtime defaults shared by the head-family exports (tree added by the calibration)."""
    return {
        "top_k": inference.top_k,
        "tree_nodes": inference.tree_nodes,
        "verifier": inference.verifier,
        "typical": {
            "posterior_threshold": inference.posterior_threshold,
            "posterior_alpha": inference.posterior_alpha,
        },
        "stop_policy": {"kind": STOP_FIXED},
    }


def make_calibration(num_heads: int, inference: TreeInferenceConfig) -> TreeCalibration:
    """Calibration for ``num_heads`` heads with the calibration-free tree of the same budget as
    fallback."""
    top_k, nodes = inference.top_k, inference.tree_nodes
    return TreeCalibration(num_heads, top_k, nodes, default_tree(num_heads, nodes, top_k))


def build_hydra(cfg: Hydra, target: Target, method: str) -> HydraObjective:
    """Hydra heads sized from the target (prefix layer sized like one of its layers)."""
    h = cfg.heads
    dims = EagleConfig.dims_from_hf(target.config) if h.prefix_layer else {}
    arch = HydraConfig(
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        num_heads=h.num_heads,
        num_layers=h.num_layers,
        dropout=h.dropout,
        share_lm_head=h.share_lm_head,
        prefix_layer=h.prefix_layer,
        **{
            k: dims[k]
            for k in (
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "intermediate_size",
                "rms_norm_eps",
                "rope_theta",
            )
            if k in dims
        },
    )
    heads = HydraHeads(arch, target.embed_weight.float(), target.lm_head_weight.float())
    return HydraObjective(
        heads,
        method,
        h.decay,
        cfg.distill.labels,
        h.topk_metric,
        make_calibration(arch.num_heads, cfg.inference),
        inference_block(cfg.inference),
        LMHeadLoss(),
    )


def build(cfg: Hydra, target: Target) -> HydraObjective:
    """Plain Hydra: grounded MLP heads, dataset labels."""
    return build_hydra(cfg, target, "hydra")


def build_pp(cfg: Hydra, target: Target) -> HydraObjective:
    """Hydra++: prefix-attention layer, deeper heads, dropout, the target's distribution as
    teacher."""
    return build_hydra(cfg, target, "hydra_pp")
