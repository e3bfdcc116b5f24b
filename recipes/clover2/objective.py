"""Clover-2 recipe: feature regression + soft cross-entropy per head, decayed per head (the paper's
code).

Head i at pair t outputs ``o_i`` for the token ``x_{t+i+2}``: ``loss_i = (feature_weight *
SmoothL1(o_i, f_{t+i+1})
+ token_weight * softCE(lm_head(o_i), p_target(. | t+i+1))) * decay^i`` over positions whose label
  ``x_{t+i+2}`` is
an assistant token (``f`` the target's post-norm feature, ``p_target`` its distribution at that
position). Defaults: feature 10, token 1, decay 0.7 (main_clover2.py). The heads read the target's
pre-norm last hidden state.
"""

from __future__ import annotations

from typing import Any

import torch

from draftsmith.common.errors import ConfigError, DataError
from draftsmith.common.trees import TreeCalibration
from draftsmith.distill.engine.objective import CalibratedObjective
from draftsmith.distill.losses.core import LMHeadLoss, masked_smooth_l1, topk_hits
from draftsmith.distill.target.frozen import FeatureTaps, Target, TargetFeatures
from draftsmith.drafters.eagle import EagleConfig
from draftsmith.heads.clover import CloverConfig, CloverHeads
from draftsmith.recipes.clover2 import Clover2
from draftsmith.recipes.hydra.objective import inference_block, make_calibration


class CloverObjective(CalibratedObjective):
    """Trains :class:`CloverHeads` on the frozen target's pre-norm states, post-norm features and
    logits."""

    def __init__(
        self,
        heads: CloverHeads,
        feature_weight: float,
        token_weight: float,
        decay: float,
        topk: int,
        calibration: TreeCalibration,
        inference: dict[str, Any],
        lm_loss: LMHeadLoss | None = None,
    ) -> None:
        self.module = heads
        self.feature_weight, self.token_weight, self.decay, self.topk = (
            feature_weight,
            token_weight,
            decay,
            topk,
        )
        self.calibration, self.inference = calibration, inference
        # fused chunked linear + CE (loss.fused_linear_ce): no [N, V] logits
        self.lm_loss = lm_loss or LMHeadLoss()
        self.taps = FeatureTaps(final_hidden=True, prenorm_hidden=True, logits=True)

    def loss(
        self, batch: dict[str, torch.Tensor], feats: TargetFeatures
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids, attn = batch["input_ids"], batch["attention_mask"]
        total_len = ids.shape[1]
        if total_len < 3:
            raise DataError(f"Clover-2 needs sequences of at least 3 tokens, got {total_len}")
        n = total_len - 1  # pairs t = 0..T-2 read (p_t, x_{t+1})
        pair_valid = attn[:, :n] * attn[:, 1:]
        c, _ = self.module.context(
            feats.prenorm_hidden[:, :n], ids[:, 1:], attention_mask=pair_valid
        )  # [B, n, H]
        outs = self.module.teacher_forced(c, ids)
        mask_all = batch["loss_mask"] * attn  # [B, T]
        total = c.new_zeros((), dtype=torch.float32)
        metrics: dict[str, torch.Tensor] = {}
        topk = self.topk if self.module.training else max(self.topk, self.calibration.stats.top_k)
        for i, out in enumerate(outs):
            rows = out.shape[1]  # T-2-i
            keep = mask_all[:, i + 2 : i + 2 + rows].bool()  # label x_{t+i+2} is an assistant token
            out_k = out[keep]  # [N, H]
            ones = torch.ones(out_k.shape[0], device=out.device)
            feature_loss = masked_smooth_l1(
                out_k, feats.final_hidden[:, i + 1 : i + 1 + rows][keep], ones
            )
            teacher = feats.logits[:, i + 1 : i + 1 + rows][
                keep
            ]  # [N, V]: the target's distribution of x_{t+i+2}
            token = self.lm_loss(
                out_k, self.module.lm_head_weight, teacher_logits=teacher, topk=topk
            )
            total = (
                total
                + (self.feature_weight * feature_loss + self.token_weight * token.loss)
                * self.decay**i
            )
            with torch.no_grad():
                greedy = teacher.argmax(-1)
                metrics[f"head{i}/feature_loss"] = feature_loss.detach()
                metrics[f"head{i}/token_loss"] = token.loss.detach()
                metrics[f"head{i}/agree_target_top1"] = topk_hits(token.topk, greedy, 1)
                metrics[f"head{i}/top{self.topk}"] = topk_hits(token.topk, greedy, self.topk)
                if not self.module.training:
                    self.calibration.stats.update_topk(i, token.topk, greedy)
        return total, metrics

    def export_config(self) -> dict[str, Any]:
        return {
            "method": "clover2",
            "architecture": self.module.architecture(),
            "inference": {"proposer": "clover2", **self.inference, **self.calibration.tree_block()},
        }


def validate(cfg: Clover2) -> None:
    """What the keys' ranges cannot say: the two loss weights are not both 0."""
    if cfg.heads.feature_weight + cfg.heads.token_weight == 0:
        raise ConfigError(
            "heads.feature_weight and heads.token_weight must not both be 0: nothing would train; "
            "give one a weight > 0"
        )


def build(cfg: Clover2, target: Target) -> CloverObjective:
    """Clover-2 sized like the target; its decoder layers start as copies of the target's last
    layer."""
    h = cfg.heads
    dims = EagleConfig.dims_from_hf(target.config)
    arch = CloverConfig(
        **{
            k: dims[k]
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "rms_norm_eps",
                "rope_theta",
            )
        },
        vocab_size=target.vocab_size,
        num_heads=h.num_heads,
        num_layers=h.num_layers,
        embed_source=h.embed_source,
    )
    backbone = (
        target.model.get_decoder() if hasattr(target.model, "get_decoder") else target.model.model
    )
    last = {k: v.float() for k, v in backbone.layers[-1].state_dict().items()}
    embed = target.lm_head_weight if arch.embed_source == "lm_head" else target.embed_weight
    heads = CloverHeads(
        arch,
        embed.float(),
        target.lm_head_weight.float(),
        init_layer=last,
        final_norm=backbone.norm.weight.float(),
    )
    return CloverObjective(
        heads,
        h.feature_weight,
        h.token_weight,
        h.decay,
        h.topk_metric,
        make_calibration(arch.num_heads, cfg.inference),
        inference_block(cfg.inference),
        LMHeadLoss(),
    )
