"""Medusa-2 recipe: Medusa heads trained jointly with the target through LoRA adapters (peft).

``L = lm_weight * L_LM + heads_coefficient * sum_k decay^(k+1) * CE_k`` (Medusa-2: lm 1, coefficient
0.2, decay 0.8). ``L_LM`` is the adapted target's own next-token CE on the dataset, or with
``adapter.self_distill`` the CE against the original target's distribution (the same model with its
adapters disabled, no second copy): KL(original || adapted) plus the original's entropy, a constant,
so the same gradients as the KL. The heads are warmed up first (``heads.warmup_steps``: the heads
train on the detached hidden state, the backbone loss is weighted 0), then everything trains
jointly, the heads at ``heads.lr_multiplier`` x ``optim.lr`` (parameter groups).

The export holds the heads as its ``model`` part and the LoRA as its ``adapter`` part; its target
identity includes the adapter's fingerprint, so it is refused against the plain target. The adapted
target's logits are computed by its LM head on the hidden state (Llama-family heads; a model with
LM-head post-processing such as Gemma-2 softcapping would need the model's own forward).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from draftsmith.common.constants import ADAPTER_LORA
from draftsmith.common.trees import TreeCalibration
from draftsmith.distill.engine.objective import CalibratedObjective
from draftsmith.distill.losses.core import LMHeadLoss, masked_cross_entropy, topk_hits
from draftsmith.distill.target.frozen import FeatureTaps, Target
from draftsmith.distill.target.lora import LoraSpec, TargetAdapter, require_peft
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
from draftsmith.recipes.hydra.objective import inference_block, make_calibration
from draftsmith.recipes.medusa.objective import medusa_draft_ids, medusa_head_loss
from draftsmith.recipes.medusa2 import AdapterConfig, Medusa2


class Medusa2Module(nn.Module):
    """Everything Medusa-2 trains: the heads and the target's LoRA (registered here and inside the
    target)."""

    def __init__(self, heads: MedusaHeads, adapter: TargetAdapter) -> None:
        super().__init__()
        self.heads = heads
        self.adapter = adapter


@dataclass
class Medusa2Features:
    """The adapted target's post-norm hidden state (with graph) and, when needed, the original
    target's logits."""

    hidden: torch.Tensor  # [B, T, H]
    original_logits: torch.Tensor | None  # [B, T, V], adapters disabled, no grad


class Medusa2Objective(CalibratedObjective):
    """Joint heads + LoRA training on one target (see the module docstring)."""

    taps = FeatureTaps(final_hidden=True)

    def __init__(
        self,
        module: Medusa2Module,
        target: Target,
        *,
        decay: float,
        heads_coefficient: float,
        lm_weight: float,
        warmup_steps: int,
        lr_multiplier: float,
        self_distill: bool,
        labels: str,
        topk: int,
        calibration: TreeCalibration,
        inference: dict[str, Any],
        lm_loss: LMHeadLoss | None = None,
    ) -> None:
        self.module = module
        # frozen, never registered here: not saved
        self.lm_head = target.model.get_output_embeddings()
        self.decay, self.heads_coefficient, self.lm_weight = decay, heads_coefficient, lm_weight
        self.warmup_steps, self.lr_multiplier = warmup_steps, lr_multiplier
        self.self_distill, self.labels, self.topk = self_distill, labels, topk
        self.calibration, self.inference = calibration, inference
        # fused chunked linear + CE (loss.fused_linear_ce): no [N, V] logits
        self.lm_loss = lm_loss or LMHeadLoss()
        self.step = 0

    def set_step(self, step: int) -> None:
        self.step = step

    @property
    def warming_up(self) -> bool:
        """Heads-only stage (training only; validation scores the joint objective)."""
        return self.module.training and self.step < self.warmup_steps

    def param_groups(self) -> list[dict[str, Any]]:
        return [
            {"params": list(self.module.heads.parameters()), "lr_scale": self.lr_multiplier},
            {"params": list(self.module.adapter.parameters())},
        ]

    def features(self, target: Target, batch: dict[str, torch.Tensor]) -> Medusa2Features:
        """The adapted forward (graph to the LoRA) and, for self-distillation / teacher labels /
        validation metrics, the original target's logits (same model, adapters disabled)."""
        ids, attn = batch["input_ids"], batch["attention_mask"]
        original = None
        if self.self_distill or self.labels != "dataset" or not self.module.training:
            with torch.no_grad(), target.adapter_disabled():
                original = target.features(
                    ids, attn, FeatureTaps(final_hidden=False, logits=True)
                ).logits
        hidden = target.features(ids, attn, FeatureTaps(final_hidden=True), grad=True).final_hidden
        return Medusa2Features(hidden, original)

    def _lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()  # [..., V]

    def _lm_parts(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target LM head as (input, weight) for the fused loss; a bias is folded in as a column
        of ones."""
        x, weight, bias = (
            hidden.to(self.lm_head.weight.dtype),
            self.lm_head.weight,
            self.lm_head.bias,
        )
        if bias is None:
            return x, weight
        return torch.cat([x, x.new_ones((*x.shape[:-1], 1))], -1), torch.cat(
            [weight, bias[:, None]], 1
        )

    def loss(
        self, batch: dict[str, torch.Tensor], feats: Medusa2Features
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids = batch["input_ids"]
        mask_all = (batch["loss_mask"] * batch["attention_mask"]).bool()  # [B, T]
        hidden = feats.hidden  # [B, T, H], graph to the adapter
        original = feats.original_logits
        # [B, T]: served target
        own_greedy = None if self.module.training else self._lm_logits(hidden).argmax(-1)
        metrics: dict[str, torch.Tensor] = {}
        lm_loss = self._backbone_loss(ids, mask_all, hidden, original)
        total = (
            0.0 if self.warming_up else self.lm_weight
        ) * lm_loss  # x0 keeps the adapter in the graph (DDP)
        head_sum = self._heads_loss(ids, mask_all, hidden, original, own_greedy, metrics)
        total = total + self.heads_coefficient * head_sum
        with torch.no_grad():
            metrics["lm_loss"] = lm_loss.detach()
            if original is not None and own_greedy is not None:
                metrics.update(self._quality_metrics(ids, mask_all, hidden, original, own_greedy))
        return total, metrics

    def _backbone_loss(
        self,
        ids: torch.Tensor,
        mask_all: torch.Tensor,
        hidden: torch.Tensor,
        original: torch.Tensor | None,
    ) -> torch.Tensor:
        """The adapted target's next-token loss at t (label x_{t+1}) through the target's own
        (frozen) LM head: soft CE to the original target under self-distillation, else CE to the
        dataset tokens."""
        keep = mask_all[:, 1:]
        lm_in, lm_weight = self._lm_parts(hidden[:, :-1][keep])  # [N, H(+1)], [V, H(+1)]
        backbone = replace(
            self.lm_loss, acceptance="none"
        )  # loss.acceptance is the heads' objective, not the model's
        # soft CE to the original target: KL plus its (constant) entropy, the same gradient
        if self.self_distill:
            return backbone(lm_in, lm_weight, teacher_logits=original[:, :-1][keep]).loss
        return backbone(lm_in, lm_weight, labels=ids[:, 1:][keep]).loss

    def _heads_loss(
        self,
        ids: torch.Tensor,
        mask_all: torch.Tensor,
        hidden: torch.Tensor,
        original: torch.Tensor | None,
        own_greedy: torch.Tensor | None,
        metrics: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """The heads' decayed loss sum (head ``k`` predicts x_{t+k+2}); each head's loss and top-1
        (and, in validation, its agreement with the served target's greedy token) go to
        ``metrics``."""
        heads = self.module.heads
        head_in = (hidden.detach() if self.warming_up else hidden).to(
            next(heads.parameters()).dtype
        )
        topk = self.topk if own_greedy is None else max(self.topk, self.calibration.stats.top_k)
        head_sum = hidden.new_zeros((), dtype=torch.float32)
        for k in range(heads.config.num_heads):
            shift = k + 2
            if ids.shape[1] <= shift:
                break
            keep = mask_all[:, shift:]  # [B, T-shift]: label x_{t+k+2} is an assistant token
            rows = head_in[:, :-shift][keep]  # [N, H]
            teacher = original[:, shift - 1 : -1][keep] if original is not None else None
            if self.labels == "target_soft":
                labels = teacher.argmax(-1)
                out = medusa_head_loss(self.lm_loss, heads, rows, k, teacher=teacher, topk=topk)
            else:
                labels = ids[:, shift:][keep] if self.labels == "dataset" else teacher.argmax(-1)
                out = medusa_head_loss(self.lm_loss, heads, rows, k, labels=labels, topk=topk)
            head_sum = head_sum + self.decay ** (k + 1) * out.loss
            with torch.no_grad():
                metrics[f"head{k}/loss"] = out.loss.detach()
                metrics[f"head{k}/top1"] = topk_hits(out.topk, labels, 1)
                if own_greedy is not None:  # acceptance is decided by the adapted (served) target
                    served = own_greedy[:, shift - 1 : -1][keep]
                    metrics[f"head{k}/agree_target_top1"] = topk_hits(out.topk, served, 1)
                    self.calibration.stats.update_topk(k, out.topk, served)
        return head_sum

    def _quality_metrics(
        self,
        ids: torch.Tensor,
        mask_all: torch.Tensor,
        hidden: torch.Tensor,
        original: torch.Tensor,
        own_greedy: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """Quality next to the original target (Medusa-2 is lossy): agreement of the greedy tokens,
        and both models' CE on the held-out dataset tokens (log-perplexity)."""
        keep = mask_all[:, 1:]
        agree = (own_greedy[:, :-1] == original[:, :-1].argmax(-1))[keep]
        ones = torch.ones(int(keep.sum()), device=ids.device)
        labels = ids[:, 1:][keep]
        return {
            "agree_original_top1": agree.float().mean() if agree.numel() else agree.new_zeros(()),
            "adapted_ce": masked_cross_entropy(self._lm_logits(hidden[:, :-1][keep]), labels, ones),
            "original_ce": masked_cross_entropy(original[:, :-1][keep].float(), labels, ones),
        }

    def export_config(self) -> dict[str, Any]:
        return {
            "method": "medusa2",
            "architecture": self.module.heads.architecture(),
            "inference": {
                "proposer": "medusa2",
                **self.inference,
                **self.calibration.tree_block(),
                "adapter": self.module.adapter.config_block(),
                "lossy": True,
            },
            "weight_parts": {
                "model": {"prefix": "heads."},
                "adapter": {"prefix": "adapter.lora.", "kind": ADAPTER_LORA},
            },
        }


def lora_spec(adapter: AdapterConfig) -> LoraSpec:
    """``adapter.*`` of the config as a :class:`LoraSpec`."""
    return LoraSpec(
        rank=adapter.rank,
        alpha=adapter.alpha,
        dropout=adapter.dropout,
        target_modules=tuple(adapter.target_modules),
    )


def validate(cfg: Medusa2) -> None:
    """Before the target loads: peft, which the adapter needs, is installed."""
    require_peft("recipe=medusa2")


def build(cfg: Medusa2, target: Target) -> Medusa2Objective:
    """Attach the LoRA to the target (ConfigError when its target modules match nothing) and build
    the heads."""
    validate(cfg)
    adapter = target.attach_lora(lora_spec(cfg.adapter))
    h = cfg.heads
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
    return Medusa2Objective(
        Medusa2Module(heads, adapter),
        target,
        decay=h.decay,
        heads_coefficient=h.coefficient,
        lm_weight=cfg.adapter.lm_weight,
        warmup_steps=h.warmup_steps,
        lr_multiplier=h.lr_multiplier,
        self_distill=cfg.adapter.self_distill,
        labels=cfg.distill.labels,
        topk=h.topk_metric,
        calibration=make_calibration(arch.num_heads, cfg.inference),
        inference=inference_block(cfg.inference),
        lm_loss=LMHeadLoss(),
    )
