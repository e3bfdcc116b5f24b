"""EAGLE-3 recipe: fused multi-layer features, training-time test (TTT) unrolling, reduced draft vocabulary.

Alignment: the pairing of drafters/eagle.py's module docstring, moved ``j`` places on at TTT step ``j``: index
``t`` reads token ``x_{t+1+j}`` and is scored against the target's distribution at position ``t+1+j``
(that of ``x_{t+2+j}``) restricted to the draft vocabulary, where ``loss_mask[t+2+j]`` is 1 and the target's
argmax is in the draft vocabulary. ``L = sum_j step_decay^j * softCE_j`` (each a mean over its scored rows;
``loss.replay_weight`` adds weight on the rows the served chain is rejected at, :meth:`Eagle3Objective.replay`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from draftsmith.common.errors import ConfigError, DataError
from draftsmith.distill.data.draft_vocab import count_draft_vocab
from draftsmith.distill.engine.objective import Objective
from draftsmith.distill.losses.core import LMHeadLoss, topk_hits
from draftsmith.distill.target.frozen import FeatureTaps, Target, TargetFeatures
from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Drafter, default_target_layers
from draftsmith.recipes.eagle.objective import eagle_inference_defaults
from draftsmith.recipes.eagle3 import Eagle3
from draftsmith.recipes.lm_loss import lm_head_loss
from draftsmith.recipes.registration import untyped

log = logging.getLogger(__name__)


def shift_left(x: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """``x[:, k:k+n]`` right-padded with zeros to length ``n`` (x [B, T, ...])."""
    out = x[:, k:k + n]
    return F.pad(out, (0, 0) * (x.dim() - 2) + (0, n - out.shape[1]))


class Eagle3Objective(Objective):
    """Trains ``Eagle3Drafter`` with ``ttt_steps`` unrolled steps of its own outputs."""

    def __init__(self, drafter: Eagle3Drafter, ttt_steps: int, step_decay: float, topk: int,
                 inference: dict[str, Any], lm_loss: LMHeadLoss | None = None) -> None:
        self.module = drafter
        self.ttt_steps, self.step_decay, self.topk = ttt_steps, step_decay, topk
        self.inference = inference
        self.lm_loss = lm_loss or LMHeadLoss()  # fused chunked linear + CE by default (loss.fused_linear_ce)
        # logits read through greedy() / logits_at() only: from a feature cache, just the draft-vocabulary rows of
        # the scored positions go through the LM head (not all [B, T, V] of them)
        self.taps = FeatureTaps(final_hidden=False, layers=tuple(drafter.config.target_layers), logits=True,
                                lazy_logits=True)

    def loss(
        self, batch: dict[str, torch.Tensor], feats: TargetFeatures
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sum over TTT steps of decayed soft-CE against the target distribution on the draft vocabulary."""
        ids, attn = batch["input_ids"], batch["attention_mask"]
        n = ids.shape[1] - 2  # pairs t = 0..T-3 have a step-0 label x_{t+2}
        if n < 1:
            raise DataError(f"EAGLE-3 needs sequences of at least 3 tokens, got {ids.shape[1]}")
        drafter = self.module
        fused_in = torch.cat([feats.layer_hidden[i] for i in drafter.config.target_layers], dim=-1)[:, :n]  # [B, N, kH]
        step_tokens = [shift_left(ids, 1 + j, n) for j in range(self.ttt_steps)]  # x_{t+1+j}, [B, N] each
        pair_valid = attn[:, :n] * attn[:, 1:n + 1]
        outputs = drafter.ttt_forward(fused_in, step_tokens, pair_valid)  # a_j [B, N, H] per step
        labels = batch["loss_mask"] * attn  # [B, T]
        in_vocab = drafter.t2d[feats.greedy()].long()  # [B, T]: target's greedy token at s+1 is draftable
        draft_ids = drafter.draft_ids_in_target()  # [Nd]
        total = outputs[0].new_zeros((), dtype=torch.float32)
        metrics: dict[str, torch.Tensor] = {}
        scored = labelled = 0
        exposed = torch.ones_like(pair_valid, dtype=torch.bool)  # [B, N]: chains every earlier step got right
        for j, hidden in enumerate(outputs):
            wanted = shift_left(labels, 2 + j, n)
            keep = (wanted * shift_left(in_vocab, 1 + j, n)).bool()  # [B, N]
            scored, labelled = scored + keep.sum(), labelled + wanted.sum()
            rows, cols = keep.nonzero(as_tuple=True)
            teacher = feats.logits_at(rows, cols + 1 + j, draft_ids)  # [M, Nd]
            # The LM head only runs on scored rows, chunked with the CE (no [M, Nd] logits when fused).
            head_in, head_w = drafter.logit_parts(hidden[keep])  # [M, H], [Nd, H]
            out = self.lm_loss(head_in, head_w, teacher_logits=teacher, topk=max(self.topk, 1))
            step_loss = out.loss
            with torch.no_grad():
                greedy = teacher.argmax(-1)  # [M] the draft id of the target's argmax (in vocab by the mask)
                right = torch.zeros_like(keep)
                right[keep] = out.topk[:, 0] == greedy  # [B, N]: the greedy draft token would be accepted
            rejected = (keep & exposed & ~right)[keep]  # [M]: where the served chain would stop at this step
            if self.lm_loss.replay_weight:
                step_loss = self.replay(step_loss, head_in, head_w, teacher, rejected)
            metrics[f"step{j}/rejected"] = rejected.float().sum() / max(rejected.numel(), 1)
            # a chain that fails here is cut by verification: its later steps never reach the target
            exposed = exposed & right
            total = total + self.step_decay ** j * step_loss
            with torch.no_grad():
                metrics[f"step{j}/loss"] = step_loss.detach()
                metrics[f"step{j}/top1"] = topk_hits(out.topk, greedy, 1)
                metrics[f"step{j}/top{self.topk}"] = topk_hits(out.topk, greedy, self.topk)
                if out.overlap is not None:  # sum_v min(p, q): the acceptance rate of speculative sampling
                    metrics[f"step{j}/overlap"] = out.overlap
        self.note_scored(int(scored), int(labelled))
        return total, metrics

    def replay(self, step_loss: torch.Tensor, head_in: torch.Tensor, head_w: torch.Tensor, teacher: torch.Tensor,
               rejected: torch.Tensor) -> torch.Tensor:
        """On-policy error-position replay (Draft-OPD, arXiv 2605.29343, in its stateless form): the step's mean
        loss plus ``replay_weight`` times the rows verification rejects, ``(1/M) sum_i (1 + w * r_i) l_i``.

        A row is rejected at step ``j`` when its chain's greedy draft tokens were accepted at steps ``0..j-1`` and
        this one is not: the position the served chain stops at. Under TTT those rows see exactly the serving
        loop's context (earlier accepted tokens equal the true ones), so no rollout is needed to find them.
        ``rejected`` [M] bool over the step's scored rows."""
        if not bool(rejected.any()):
            return step_loss
        extra = self.lm_loss(head_in[rejected], head_w, teacher_logits=teacher[rejected]).loss  # mean over them
        return step_loss + self.lm_loss.replay_weight * extra * rejected.float().mean()

    def note_scored(self, scored: int, labelled: int) -> None:
        """How many positions the batch scored, and why none when none: the loss mask, or a draft vocabulary that
        never holds the target's greedy token."""
        self.last_scored, self.unscored_reason = scored, None
        if scored == 0 and labelled > 0:
            d = self.module.config
            self.unscored_reason = (
                f"the target's greedy token is in the EAGLE-3 draft vocabulary at none of {labelled} assistant "
                f"positions (drafter.draft_vocab_size={d.draft_vocab_size} of {d.vocab_size}, counted on the training "
                "data): the target does not predict the data's tokens. Check that target and data match (a random "
                "or untrained target?), or raise drafter.draft_vocab_size (0 = the full vocabulary)")

    def export_config(self) -> dict[str, Any]:
        return {"method": "eagle3", "architecture": self.module.architecture(), "inference": dict(self.inference)}


def build_objective(cfg: Eagle3, target: Target,
                    vocab_batches: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Eagle3Objective:
    """The objective; ``vocab_batches`` (iterable of (input_ids, loss_mask)) overrides the training-data scan."""
    d = cfg.drafter
    vocab = target.vocab_size
    try:
        layers = tuple(d.target_layers) if d.target_layers else default_target_layers(target.num_layers)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    bad = [i for i in layers if not 0 <= i < target.num_layers]
    if bad:
        raise ConfigError(f"drafter.target_layers {list(layers)} has {bad} outside 0..{target.num_layers - 1} (HF "
                          "hidden_states indices: i = input of decoder layer i)")
    draft_vocab = min(d.draft_vocab_size or vocab, vocab)
    d2t = t2d = None
    if draft_vocab < vocab:
        d2t, t2d = count_draft_vocab(untyped(cfg), target, draft_vocab, d.vocab_samples, vocab_batches)
    arch = Eagle3Config(**{**Eagle3Config.dims_from_hf(target.config), "vocab_size": vocab},
                        draft_vocab_size=draft_vocab, target_layers=layers)
    drafter = Eagle3Drafter(arch, target.embed_weight.float(), d2t, t2d)
    if d.init_lm_head_from_target:
        drafter.init_lm_head(target.lm_head_weight.float())
    return Eagle3Objective(drafter, d.ttt_steps, d.step_decay, d.topk_metric, eagle_inference_defaults(cfg.inference),
                           lm_head_loss(cfg.loss))


def build(cfg: Eagle3, target: Target) -> Eagle3Objective:
    """An EAGLE-3 drafter sized from the target; the draft vocabulary is counted on the training split."""
    return build_objective(cfg, target)
