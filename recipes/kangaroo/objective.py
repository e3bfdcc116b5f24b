"""Kangaroo recipe: distil the target's final distribution into its own first layers + a one-block
adapter.

``python train.py recipe=kangaroo [drafter.exit_layer=N]``. One target forward gives the shallow
state (tap ``layers=(exit_layer,)``, computed by the very layers the drafter shares) and the
target's logits at every position. The adapter at position t reads the shallow states up to t and is
trained with soft cross-entropy against the target's distribution at the same position t (both
predict token t+1; Kangaroo shifts nothing further), on rows whose next token is an assistant label.
Logged: ``accept`` = mean over rows of ``sum_v min(p_target, q_draft)``, the expected acceptance of
one drafted token under speculative sampling, and top-1 agreement.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from draftsmith.common.constants import STOP_CONFIDENCE
from draftsmith.common.errors import ConfigError, DataError
from draftsmith.distill.engine.objective import Objective
from draftsmith.distill.losses.core import LMHeadLoss, topk_hits
from draftsmith.distill.target.frozen import FeatureTaps, Target, TargetFeatures
from draftsmith.drafters.eagle import EagleConfig
from draftsmith.drafters.kangaroo import (
    KangarooConfig,
    KangarooDrafter,
    check_exit_layer,
    default_exit_layer,
)
from draftsmith.recipes.kangaroo import Kangaroo
from draftsmith.recipes.lm_loss import lm_head_loss


def expected_acceptance(
    draft_in: torch.Tensor, weight: torch.Tensor, teacher_logits: torch.Tensor, chunk: int = 256
) -> torch.Tensor:
    """Mean over rows of ``sum_v min(p, q)`` with q = softmax(draft_in @ weight^T), p =
    softmax(teacher_logits); rows in chunks so the [N, V] logits never exist at once."""
    if draft_in.shape[0] == 0:
        return torch.zeros((), device=draft_in.device)
    total = torch.zeros((), device=draft_in.device, dtype=torch.float32)
    for i in range(0, draft_in.shape[0], chunk):
        q = F.softmax(F.linear(draft_in[i : i + chunk].float(), weight.float()), -1)  # [c, V]
        p = F.softmax(teacher_logits[i : i + chunk].float(), -1)
        total = total + torch.minimum(p, q).sum()
    return total / draft_in.shape[0]


class KangarooObjective(Objective):
    """Soft CE between the adapter's draft and the target at the same position (see the module
    docstring)."""

    def __init__(
        self,
        drafter: KangarooDrafter,
        inference: dict[str, Any],
        lm_loss: LMHeadLoss | None,
        topk: int,
    ) -> None:
        self.module = drafter
        self.inference = inference
        self.lm_loss = lm_loss or LMHeadLoss()
        self.topk = topk
        self.taps = FeatureTaps(
            final_hidden=False, layers=(drafter.config.exit_layer,), logits=True
        )

    def loss(
        self, batch: dict[str, torch.Tensor], feats: TargetFeatures
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Masked mean soft CE over rows t whose next token t+1 is an assistant label."""
        ids, attn = batch["input_ids"], batch["attention_mask"]
        n = ids.shape[1] - 1  # rows t = 0..T-2 predict token t+1
        if n < 1:
            raise DataError(f"Kangaroo needs sequences of at least 2 tokens, got {ids.shape[1]}")
        shallow = feats.layer_hidden[self.module.config.exit_layer][:, :n]  # [B, N, H]
        out, _ = self.module(
            shallow, attention_mask=attn[:, :n]
        )  # [B, N, H] post-norm draft features
        keep = (batch["loss_mask"][:, 1:] * attn[:, 1:]).bool()  # [B, N]
        teacher = feats.logits[:, :n][keep]  # [M, V] the target's distribution of token t+1
        rows = out[keep]  # [M, H]
        res = self.lm_loss(*self.module.logit_parts(rows), teacher_logits=teacher, topk=self.topk)
        with torch.no_grad():
            greedy = teacher.argmax(-1)
            metrics = {
                "accept": expected_acceptance(rows.detach(), self.module.lm_head_weight, teacher),
                "top1": topk_hits(res.topk, greedy, 1),
                f"top{self.topk}": topk_hits(res.topk, greedy, self.topk),
            }
        return res.loss, metrics

    def export_config(self) -> dict[str, Any]:
        return {
            "method": "kangaroo",
            "architecture": self.module.architecture(),
            "inference": dict(self.inference),
        }


def resolve_exit_layer(value: Any, num_layers: int) -> int:
    """``drafter.exit_layer``: ``auto`` (the notes' 2-of-32 scaled to the target's depth) or an int
    in its depth."""
    if value in (None, "auto"):
        return default_exit_layer(num_layers)
    try:
        return check_exit_layer(int(value), num_layers)
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"drafter.exit_layer={value!r}: {err}"
            if "outside" in str(err)
            else f"drafter.exit_layer={value!r}: use auto or an integer in 1..{num_layers - 1}"
        ) from None


def _final_norm(target: Any) -> torch.Tensor | None:
    """The target's final RMSNorm weight (the adapter's norm starts from it), when the model exposes
    one."""
    model = getattr(target, "model", None)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    norm = getattr(decoder, "norm", None)
    return None if norm is None else norm.weight


def build(cfg: Kangaroo, target: Target) -> KangarooObjective:
    """The adapter sized like one target attention block; shallow layers and LM head shared with the
    target."""
    dims = EagleConfig.dims_from_hf(target.config)
    exit_layer = resolve_exit_layer(cfg.drafter.exit_layer, target.num_layers)
    arch = KangarooConfig(
        hidden_size=dims["hidden_size"],
        vocab_size=target.vocab_size,
        num_attention_heads=dims["num_attention_heads"],
        num_key_value_heads=dims["num_key_value_heads"],
        exit_layer=exit_layer,
        num_target_layers=target.num_layers,
        head_dim=dims["head_dim"],
        rms_norm_eps=dims["rms_norm_eps"],
        rope_theta=dims["rope_theta"],
        max_position_embeddings=dims["max_position_embeddings"],
    )
    decoder = (
        target.model.get_decoder()
        if hasattr(getattr(target, "model", None), "get_decoder")
        else None
    )
    shallow = tuple(decoder.layers[:exit_layer]) if decoder is not None else ()
    drafter = KangarooDrafter(arch, target.lm_head_weight.float(), shallow, _final_norm(target))
    inf = cfg.inference
    inference = {
        "proposer": "kangaroo",
        "threshold": inf.threshold,
        "max_depth": inf.max_depth,
        "verifier": inf.verifier,
        "stop_policy": {
            "kind": STOP_CONFIDENCE,
            "threshold": inf.threshold,
            "max_depth": inf.max_depth,
        },
    }
    return KangarooObjective(drafter, inference, lm_head_loss(cfg.loss), cfg.drafter.topk_metric)
