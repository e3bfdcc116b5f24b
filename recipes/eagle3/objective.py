"""EAGLE-3 recipe: fused multi-layer features, training-time test (TTT) unrolling, reduced draft
vocabulary.

Alignment: the pairing of drafters/eagle.py's module docstring, moved ``j`` places on at TTT step
``j``: index ``t`` reads token ``x_{t+1+j}`` and is scored against the target's distribution at
position ``t+1+j`` (that of ``x_{t+2+j}``) restricted to the draft vocabulary, where
``loss_mask[t+2+j]`` is 1 and the target's argmax is in the draft vocabulary. ``L = sum_j
step_decay^j * softCE_j`` (each a mean over its scored rows; ``loss.replay_weight`` adds weight on
the rows the served chain is rejected at, :func:`draftsmith.distill.losses.ttt.replay_term`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from draftsmith.common.errors import ConfigError
from draftsmith.distill.data.draft_vocab import count_draft_vocab
from draftsmith.distill.engine.objective import Objective
from draftsmith.distill.losses.core import LMHeadLoss
from draftsmith.distill.losses.ttt import eagle3_ttt_loss, unscored_reason
from draftsmith.distill.target.frozen import FeatureTaps, Target, TargetFeatures
from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Drafter, default_target_layers
from draftsmith.recipes.eagle.objective import eagle_inference_defaults
from draftsmith.recipes.eagle3 import Eagle3
from draftsmith.recipes.lm_loss import lm_head_loss
from draftsmith.recipes.registration import untyped

log = logging.getLogger(__name__)


class Eagle3Objective(Objective):
    """Trains ``Eagle3Drafter`` with ``ttt_steps`` unrolled steps of its own outputs."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        ttt_steps: int,
        step_decay: float,
        topk: int,
        inference: dict[str, Any],
        lm_loss: LMHeadLoss | None = None,
    ) -> None:
        self.module = drafter
        self.ttt_steps, self.step_decay, self.topk = ttt_steps, step_decay, topk
        self.inference = inference
        # fused chunked linear + CE by default (loss.fused_linear_ce)
        self.lm_loss = lm_loss or LMHeadLoss()
        # logits read through greedy() / logits_at() only: from a feature cache, just the
        # draft-vocabulary rows of the scored positions go through the LM head (not all [B, T, V] of
        # them)
        self.taps = FeatureTaps(
            final_hidden=False,
            layers=tuple(drafter.config.target_layers),
            logits=True,
            lazy_logits=True,
        )

    def loss(
        self, batch: dict[str, torch.Tensor], feats: TargetFeatures
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sum over TTT steps of decayed soft-CE against the target distribution on the draft
        vocabulary (static shapes, no host read-back:
        :func:`draftsmith.distill.losses.ttt.eagle3_ttt_loss`)."""
        out = eagle3_ttt_loss(
            self.module, self.lm_loss, batch, feats, self.ttt_steps, self.step_decay, self.topk
        )
        self.last_scored, self.last_labelled = (
            out.scored,
            out.labelled,
        )  # tensors, read by the guards on log steps
        return out.total, out.metrics

    @property
    def unscored_reason(self) -> str | None:
        return unscored_reason(
            self.module.config, self.last_scored, getattr(self, "last_labelled", None)
        )

    def export_config(self) -> dict[str, Any]:
        return {
            "method": "eagle3",
            "architecture": self.module.architecture(),
            "inference": dict(self.inference),
        }


def build_objective(
    cfg: Eagle3,
    target: Target,
    vocab_batches: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Eagle3Objective:
    """The objective; ``vocab_batches`` (iterable of (input_ids, loss_mask)) overrides the
    training-data scan."""
    d = cfg.drafter
    vocab = target.vocab_size
    try:
        layers = (
            tuple(d.target_layers) if d.target_layers else default_target_layers(target.num_layers)
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None
    bad = [i for i in layers if not 0 <= i < target.num_layers]
    if bad:
        raise ConfigError(
            f"drafter.target_layers {list(layers)} has {bad} outside 0..{target.num_layers - 1} (HF"
            " hidden_states indices: i = input of decoder layer i)"
        )
    draft_vocab = min(d.draft_vocab_size or vocab, vocab)
    d2t = t2d = None
    if draft_vocab < vocab:
        d2t, t2d = count_draft_vocab(
            untyped(cfg), target, draft_vocab, d.vocab_samples, vocab_batches
        )
    arch = Eagle3Config(
        **{**Eagle3Config.dims_from_hf(target.config), "vocab_size": vocab},
        draft_vocab_size=draft_vocab,
        target_layers=layers,
    )
    drafter = Eagle3Drafter(arch, target.embed_weight.float(), d2t, t2d)
    if d.init_lm_head_from_target:
        drafter.init_lm_head(target.lm_head_weight.float())
    return Eagle3Objective(
        drafter,
        d.ttt_steps,
        d.step_decay,
        d.topk_metric,
        eagle_inference_defaults(cfg.inference),
        lm_head_loss(cfg.loss),
    )


def build(cfg: Eagle3, target: Target) -> Eagle3Objective:
    """An EAGLE-3 drafter sized from the target; the draft vocabulary is counted on the training
    split."""
    return build_objective(cfg, target)
