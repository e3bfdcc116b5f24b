"""EAGLE-1 recipe: regress the target's next post-norm feature and match its next-token
distribution.

Alignment: the pairing of drafters/eagle.py's module docstring (pair ``t`` = ``(f_t, x_{t+1})``
predicts ``f̂_{t+1}`` and ``x_{t+2}``). Its targets are ``f_{t+1}`` and the target's logits at
position ``t+1``; both losses use ``loss_mask[t+2]`` (distill/data/samples.py: ``loss_mask[s] == 1``
when token ``s`` is an assistant label).

``L = feature_weight * SmoothL1(f̂_{t+1}, f_{t+1}) + token_weight * softCE(lm_head(f̂_{t+1}),
p_target(. | t+1))``.

Input noise (``drafter.noise``): the paper adds U(-0.1, 0.1) to the target features the drafter
reads, whatever the batch shape. EAGLE's reference code instead scales its noise by ``512 / T`` (T =
padded width), about +-1 on short buckets; ``noise.ref_len: 512`` reproduces that. The older keys
``drafter.noise_std`` / ``noise_ref_len`` are still read when set: ``(U(0,1) - 0.5) * noise_std *
noise_ref_len / T``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from draftsmith.common.constants import EAGLE_TREE_PROPOSER, STOP_FIXED
from draftsmith.common.errors import ConfigError, DataError
from draftsmith.distill.engine.objective import Objective
from draftsmith.distill.losses.core import LMHeadLoss, masked_smooth_l1, topk_hits
from draftsmith.distill.target.frozen import FeatureTaps, Target, TargetFeatures
from draftsmith.drafters.eagle import EagleConfig, EagleDrafter
from draftsmith.recipes.eagle import Eagle, EagleDrafterConfig
from draftsmith.recipes.groups import DynamicTreeInferenceConfig
from draftsmith.recipes.lm_loss import lm_head_loss


@dataclass(frozen=True)
class FeatureNoise:
    """Training-time noise on the drafter's input features: ``uniform`` adds U(-scale, scale)
    elementwise.

    ``ref_len`` (None: off) multiplies the scale by ``ref_len / T`` for a batch of padded width T,
    as EAGLE's reference code does with 512. The values come from ``drafter.noise``
    (recipes/eagle/__init__.py checks them).
    """

    kind: str
    scale: float
    ref_len: int | None

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        """``features`` [B, T, H] plus fresh noise (unchanged for kind ``none`` or scale 0)."""
        if self.kind == "none" or self.scale == 0:
            return features
        bound = self.scale * (self.ref_len / features.shape[1] if self.ref_len else 1.0)
        return features + (torch.rand_like(features) * 2 - 1) * bound


def uniform_feature_noise(features: torch.Tensor, std: float, ref_len: int | None) -> torch.Tensor:
    """The older length-scaled form: ``f + (U(0,1) - 0.5) * std * ref_len / T`` (no scaling if
    ref_len is None)."""
    return FeatureNoise("uniform", std / 2, ref_len)(features) if std > 0 else features


def noise_from_config(d: EagleDrafterConfig) -> FeatureNoise:
    """``drafter.noise`` ({kind, scale, ref_len}); the older ``drafter.noise_std`` /
    ``noise_ref_len``, when set, take precedence so configs written for them keep their meaning."""
    if d.noise_std is not None:
        return FeatureNoise(
            "uniform" if d.noise_std > 0 else "none", d.noise_std / 2, d.noise_ref_len or None
        )
    return FeatureNoise(d.noise.kind, d.noise.scale, d.noise.ref_len or None)


def eagle_inference_defaults(inference: DynamicTreeInferenceConfig) -> dict[str, Any]:
    """The ``inference`` block of EAGLE-family exports (EAGLE-2 dynamic tree sizes, verifier, stop
    policy)."""
    return {
        "proposer": EAGLE_TREE_PROPOSER,
        "total_tokens": inference.total_tokens,
        "depth": inference.depth,
        "top_k": inference.top_k,
        "verifier": inference.verifier,
        "stop_policy": {"kind": STOP_FIXED},
    }


class EagleObjective(Objective):
    """Trains ``EagleDrafter`` on (feature, next token) pairs of the frozen target."""

    def __init__(
        self,
        drafter: EagleDrafter,
        feature_weight: float,
        token_weight: float,
        noise: FeatureNoise,
        topk: int,
        inference: dict[str, Any],
        lm_loss: LMHeadLoss | None = None,
    ) -> None:
        self.module = drafter
        self.feature_weight, self.token_weight = feature_weight, token_weight
        self.noise = noise
        self.topk = topk
        self.inference = inference
        # fused chunked linear + CE by default (loss.fused_linear_ce)
        self.lm_loss = lm_loss or LMHeadLoss()
        self.taps = FeatureTaps(final_hidden=True, logits=True)

    def loss(
        self, batch: dict[str, torch.Tensor], feats: TargetFeatures
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Weighted feature regression + soft CE over pairs whose predicted token is an assistant
        label."""
        ids, attn = batch["input_ids"], batch["attention_mask"]
        final = feats.final_hidden  # [B, T, H] post-norm
        n = ids.shape[1] - 2  # pairs t = 0..T-3 have a label x_{t+2}
        if n < 1:
            raise DataError(f"EAGLE needs sequences of at least 3 tokens, got {ids.shape[1]}")
        inputs = final[:, :n]  # f_t, [B, N, H]
        if self.module.training:
            inputs = self.noise(inputs)
        pair_valid = attn[:, :n] * attn[:, 1 : n + 1]  # both f_t and x_{t+1} are real tokens
        pred, _ = self.module(ids[:, 1 : n + 1], inputs, attention_mask=pair_valid)  # [B, N, H]
        # [B, N]: label x_{t+2} is an assistant token
        mask = batch["loss_mask"][:, 2:] * attn[:, 2:]
        keep = mask.bool()
        pred_k = pred[keep]  # [M, H]; the V-wide LM head only runs on scored rows
        ones = torch.ones(pred_k.shape[0], device=pred.device)
        feature_loss = masked_smooth_l1(pred_k, final[:, 1 : n + 1][keep], ones)
        teacher = feats.logits[:, 1 : n + 1][keep]  # [M, V]: the target's distribution of x_{t+2}
        out = self.lm_loss(
            *self.module.logit_parts(pred_k), teacher_logits=teacher, topk=self.topk
        )  # no [M, V] logits
        token_loss = out.loss
        total = self.feature_weight * feature_loss + self.token_weight * token_loss
        with torch.no_grad():
            greedy = teacher.argmax(-1)
            metrics = {
                "feature_loss": feature_loss.detach(),
                "token_loss": token_loss.detach(),
                "top1": topk_hits(out.topk, greedy, 1),
                f"top{self.topk}": topk_hits(out.topk, greedy, self.topk),
            }
        return total, metrics

    def export_config(self) -> dict[str, Any]:
        return {
            "method": "eagle",
            "architecture": self.module.architecture(),
            "inference": dict(self.inference),
        }


def validate(cfg: Eagle) -> None:
    """What the keys' ranges cannot say: the two loss weights are not both 0."""
    if cfg.drafter.feature_weight + cfg.drafter.token_weight == 0:
        raise ConfigError(
            "drafter.feature_weight and drafter.token_weight must not both be 0: nothing would"
            " train; give one a weight > 0"
        )


def build(cfg: Eagle, target: Target) -> EagleObjective:
    """An EAGLE-1 drafter sized from the target, with its embedding and LM head shared (frozen)."""
    d = cfg.drafter
    # vocab_size from the LM head rows: some checkpoints pad the matrix beyond config.vocab_size.
    arch = EagleConfig(
        **{**EagleConfig.dims_from_hf(target.config), "vocab_size": target.vocab_size}
    )
    drafter = EagleDrafter(arch, target.embed_weight.float(), target.lm_head_weight.float())
    return EagleObjective(
        drafter,
        d.feature_weight,
        d.token_weight,
        noise_from_config(d),
        d.topk_metric,
        eagle_inference_defaults(cfg.inference),
        lm_head_loss(cfg.loss),
    )
