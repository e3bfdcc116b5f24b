"""DFlash recipe: a block drafter trained on random anchors with position-weighted soft
cross-entropy.

Blocks and alignment: recipes/dflash/blocks.py (slot ``k`` of the block anchored at ``a`` is scored
against the target's logits at ``a+k-1``, i.e. the target's own distribution of token ``a+k``; soft
CE, so the drafter learns the target's distribution, which is also what rejection sampling accepts;
its top-1 is compared with the target argmax).

Position weighting: ``L_tok = sum_k w_k CE_k / sum_k w_k`` over the slots that scored rows, with
``w_k = position_decay^(k-1)`` (each ``CE_k`` a mean over its rows). Why: slot ``k``'s token is only
used when slots ``1..k-1`` were all accepted, so its expected value to tau falls geometrically with
``k``; the decay puts the drafter's capacity where acceptance is decided (DFlash's paper uses the
same exponential-decay shape).

Options: the confidence head (BCE on "slot k's greedy draft equals the target's greedy token", on
slots whose earlier slots all matched; weight ``confidence_weight``; it reads detached states, so it
never pulls on the drafter) and the Markov head (teacher forcing: slot ``k``'s previous token is
``x_a`` for ``k = 1``, else the target's greedy token at slot ``k-1``), both in
drafters/dflash_heads.py.

Mask token: recipes/dflash/mask_token.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from draftsmith.common.errors import ConfigError, DataError
from draftsmith.distill.engine.objective import Objective
from draftsmith.distill.losses.core import LMHeadLoss, topk_hits
from draftsmith.distill.target.frozen import FeatureTaps, TargetFeatures
from draftsmith.drafters.dflash import DFlashDrafter
from draftsmith.recipes.dflash import DFlash
from draftsmith.recipes.dflash.blocks import Blocks, build_blocks, sample_anchors
from draftsmith.recipes.dflash.cut import CutSearch

log = logging.getLogger(__name__)


@dataclass
class _Tally:
    """Running sums of one batch's slots."""

    conf_loss: torch.Tensor  # summed BCE of the confidence head
    matched: torch.Tensor  # [B, A] bool: every earlier slot's greedy draft matched the target's
    accepted: torch.Tensor  # [B, A] long: greedy-accepted prefix length
    total: torch.Tensor | float = 0.0  # sum_k w_k CE_k
    weights: float = 0.0  # sum_k w_k over slots with rows
    conf_rows: int = 0
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    # [B, A, S-1]: the head's P(accept) of every slot (validation, auto cut)
    confidence: torch.Tensor | None = None


class DFlashObjective(Objective):
    """Trains ``DFlashDrafter`` on ``anchors_per_seq`` random blocks per sequence."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        anchors_per_seq: int,
        position_decay: float,
        confidence_weight: float,
        topk: int,
        inference: dict[str, Any],
        lm_loss: LMHeadLoss | None = None,
        cut_search: CutSearch | None = None,
    ) -> None:
        self.module = drafter
        self.anchors_per_seq, self.position_decay = anchors_per_seq, position_decay
        self.confidence_weight, self.topk = confidence_weight, topk
        self.inference = inference
        self.lm_loss = lm_loss or LMHeadLoss()  # fused chunked linear + CE: no [M, V] logits
        self.taps = FeatureTaps(
            final_hidden=False, layers=tuple(drafter.config.target_layers), logits=True
        )
        # anchors' randomness (None = torch's global RNG)
        self.generator: torch.Generator | None = None
        # inference.cut null + a confidence head: validation picks the served cut
        self.cut_search = cut_search

    def loss(
        self, batch: dict[str, torch.Tensor], feats: TargetFeatures
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Position-weighted soft CE over every scored slot (+ the confidence head's BCE)."""
        ids, attn, labels = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        d, c = self.module, self.module.config
        if ids.shape[1] < 3:
            raise DataError(f"DFlash needs sequences of at least 3 tokens, got {ids.shape[1]}")
        taps = torch.cat([feats.layer_hidden[i] for i in c.target_layers], dim=-1)  # [B, T, n*H_t]
        anchors, valid = sample_anchors(labels, attn, self.anchors_per_seq, self.generator)
        blocks = build_blocks(ids, labels, attn, anchors, valid, c.block_size, c.mask_token_id)
        bsz, seq = ids.shape
        ctx = d.context(taps, torch.arange(seq, device=ids.device).expand(bsz, seq))
        hidden = d.block_forward(
            blocks.block_ids, blocks.positions, ctx, blocks.mask
        )  # [B, A*S, H]
        hidden = hidden.view(bsz, self.anchors_per_seq, c.block_size, -1)  # [B, A, S, H]
        tally = _Tally(hidden.new_zeros(()), torch.ones_like(valid), torch.zeros_like(anchors))
        # validation: record what the cut would do
        searching = self.cut_search is not None and not d.training
        if searching:
            tally.confidence = hidden.new_zeros(
                bsz, self.anchors_per_seq, c.block_size - 1, dtype=torch.float32
            )
        greedy = feats.logits.argmax(-1)  # [B, T]: the target's greedy next token at every position
        prev = ids.gather(1, anchors)  # [B, A]: slot 1's previous token is x_a
        for k in range(1, c.block_size):
            prev = self._slot(k, hidden, blocks, feats.logits, greedy, prev, tally)
        loss = tally.total / tally.weights if tally.weights else hidden.sum() * 0.0
        if tally.conf_rows:
            conf = tally.conf_loss / tally.conf_rows
            loss = loss + self.confidence_weight * conf
            tally.metrics["confidence_bce"] = conf.detach()
        self.last_scored = int(blocks.scored.sum())
        if searching:
            real = valid.bool()  # [B, A]
            self.cut_search.add(
                tally.confidence[real], blocks.scored.sum(-1)[real], tally.accepted[real]
            )
        # Greedy-accepted drafts per real block: the training-time estimate of tau - 1.
        tally.metrics["accept_len"] = tally.accepted.float().sum() / valid.sum().clamp_min(1)
        return loss, tally.metrics

    def _slot(
        self,
        k: int,
        hidden: torch.Tensor,
        blocks: Blocks,
        logits: torch.Tensor,
        greedy: torch.Tensor,
        prev: torch.Tensor,
        tally: _Tally,
    ) -> torch.Tensor:
        """Score slot ``k`` of every block into ``tally``; returns the slot's teacher token (the
        next slot's Markov input, teacher forcing) [B, A]."""
        d = self.module
        keep = blocks.scored[:, :, k - 1]  # [B, A]
        pos = blocks.label_pos[:, :, k - 1]  # [B, A]: a+k
        rows_b = torch.arange(keep.shape[0], device=keep.device)[:, None].expand_as(keep)  # [B, A]
        teacher_greedy = greedy[rows_b, pos - 1]  # [B, A]: the target's token at a+k
        if not keep.any():
            tally.matched = torch.zeros_like(tally.matched)
            return teacher_greedy
        head_in = d.head_input(hidden[:, :, k][keep], prev[keep])  # [M, H]
        teacher = logits[rows_b[keep], pos[keep] - 1]  # [M, V]
        # The LM head only runs on scored rows, chunked with the CE (no [M, V] logits when fused).
        out = self.lm_loss(*d.logit_parts(head_in), teacher_logits=teacher, topk=self.topk)
        w = self.position_decay ** (k - 1)
        tally.total, tally.weights = tally.total + w * out.loss, tally.weights + w
        hit = out.topk[:, 0] == teacher_greedy[keep]  # [M]
        if d.confidence_head is not None:
            live = tally.matched[
                keep
            ]  # conditional label: only slots whose earlier slots all matched
            logit = d.confidence_logit(head_in.detach()[live], out.topk[live, 0])
            tally.conf_loss = tally.conf_loss + F.binary_cross_entropy_with_logits(
                logit, hit[live].float(), reduction="sum"
            )
            tally.conf_rows += int(live.sum())
            # every scored slot's P(accept), as the runtime's cut reads it
            if tally.confidence is not None:
                with torch.no_grad():
                    tally.confidence[:, :, k - 1][keep] = torch.sigmoid(
                        d.confidence_logit(head_in.detach(), out.topk[:, 0])
                    ).float()
        with torch.no_grad():
            tally.metrics[f"slot{k}/loss"] = out.loss.detach()
            tally.metrics[f"slot{k}/top1"] = topk_hits(out.topk, teacher_greedy[keep], 1)
            tally.metrics[f"slot{k}/top{self.topk}"] = topk_hits(
                out.topk, teacher_greedy[keep], self.topk
            )
            step = torch.zeros_like(tally.matched)
            step[keep] = hit
            tally.matched = tally.matched & step
            tally.accepted = tally.accepted + tally.matched.long()
        return teacher_greedy

    def on_validation_start(self) -> None:
        if self.cut_search is not None:
            self.cut_search.reset()

    def on_validation_end(self, reduce_sum: Any = None) -> None:
        """With ``inference.cut`` null, serve the head at the cut this validation pass found
        best."""
        found = self.cut_search.best(reduce_sum) if self.cut_search is not None else None
        if found is not None:
            self.inference["cut"] = found[0]
            log.info(
                "DFlash: validation picked confidence cut %.2f (%.3f accepted tokens per verify"
                " cost)",
                *found,
            )

    def export_config(self) -> dict[str, Any]:
        return {
            "method": "dflash",
            "architecture": self.module.architecture(),
            "inference": dict(self.inference),
        }


def validate(cfg: DFlash) -> None:
    """What one key's range cannot say: a block fits the context (``data.max_length``)."""
    if cfg.drafter.block_size >= cfg.data.max_length:
        raise ConfigError(
            f"drafter.block_size={cfg.drafter.block_size} is larger than the context:"
            f" data.max_length={cfg.data.max_length} must exceed it (a block needs a context"
            " position before it)"
        )
