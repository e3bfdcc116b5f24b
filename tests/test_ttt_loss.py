"""The sync-free EAGLE-3 TTT loss (0/1 row weights, one teacher over the draft vocabulary) equals
the boolean-indexing formulation it replaced (kept below as the reference) in value, metrics and
gradients, on fixed padded batches, with on-policy replay, the acceptance loss and the unfused
head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_llama
from test_eagle3 import make_objective

from draftsmith.distill.losses.core import LMHeadLoss
from draftsmith.distill.losses.ttt import eagle3_ttt_loss, shift_left, unscored_reason
from draftsmith.distill.target.frozen import Target

pytestmark = pytest.mark.unit


def reference_loss(drafter, lm_loss, batch, feats, ttt_steps, step_decay, topk):
    """The boolean-indexing loss as recipes/eagle3.py computed it before (rows picked with
    ``keep.nonzero()``, the teacher gathered per step from the full logits, replay on the rejected
    subset)."""

    def shift(x, k, n):
        out = x[:, k : k + n]
        return F.pad(out, (0, 0) * (x.dim() - 2) + (0, n - out.shape[1]))

    ids, attn = batch["input_ids"], batch["attention_mask"]
    n = ids.shape[1] - 2
    fused_in = torch.cat([feats.layer_hidden[i] for i in drafter.config.target_layers], dim=-1)[
        :, :n
    ]
    outputs = drafter.ttt_forward(
        fused_in, [shift(ids, 1 + j, n) for j in range(ttt_steps)], attn[:, :n] * attn[:, 1 : n + 1]
    )
    labels, in_vocab = batch["loss_mask"] * attn, drafter.t2d[feats.greedy()].long()
    draft_ids = drafter.draft_ids_in_target()
    total, metrics, scored = 0.0, {}, 0
    exposed = torch.ones(ids.shape[0], n, dtype=torch.bool)
    for j, hidden in enumerate(outputs):
        keep = (shift(labels, 2 + j, n) * shift(in_vocab, 1 + j, n)).bool()
        scored += int(keep.sum())
        rows, cols = keep.nonzero(as_tuple=True)
        teacher = feats.logits_at(rows, cols + 1 + j, draft_ids)
        head_in, head_w = drafter.logit_parts(hidden[keep])
        out = lm_loss(head_in, head_w, teacher_logits=teacher, topk=topk)
        greedy = teacher.argmax(-1)
        right = torch.zeros_like(keep)
        right[keep] = out.topk[:, 0] == greedy
        rejected = (keep & exposed & ~right)[keep]
        step_loss = out.loss
        if lm_loss.replay_weight and rejected.any():
            extra = lm_loss(head_in[rejected], head_w, teacher_logits=teacher[rejected]).loss
            step_loss = step_loss + lm_loss.replay_weight * extra * rejected.float().mean()
        exposed = exposed & right
        total = total + step_decay**j * step_loss
        hits = out.topk == greedy[:, None]
        metrics[f"step{j}/loss"] = step_loss.detach()
        metrics[f"step{j}/rejected"] = rejected.float().sum() / max(rejected.numel(), 1)
        for k in (1, topk):
            metrics[f"step{j}/top{k}"] = (
                hits[:, :k].any(-1).float().mean() if len(hits) else torch.zeros(())
            )
        if out.overlap is not None:
            metrics[f"step{j}/overlap"] = out.overlap
    return total, metrics, scored


@pytest.fixture(scope="module")
def target(tiny_tokenizer) -> Target:
    return Target(
        build_tiny_llama(len(tiny_tokenizer), initializer_range=0.2), tiny_tokenizer, "tiny"
    )


def fixed_batch(vocab: int, seed: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 9:], attn[2, 6:] = 0, 0  # right padding
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": (torch.rand(3, 12, generator=g) > 0.3).long(),
    }


@pytest.mark.parametrize(
    "lm_loss",
    [
        LMHeadLoss(),
        LMHeadLoss(fused=False),
        LMHeadLoss(replay_weight=0.7),
        LMHeadLoss(acceptance="hybrid"),
        LMHeadLoss(chunk_size=5),
    ],
    ids=["fused", "unfused", "replay", "acceptance", "small-chunks"],
)
def test_the_sync_free_loss_equals_the_boolean_indexing_loss(target, lm_loss):
    objective = make_objective(target, draft_vocab=60, ttt_steps=3)
    for p in objective.module.parameters():
        p.data.normal_(0, 0.1)
    batch = fixed_batch(target.vocab_size)
    feats = target.features(batch["input_ids"], batch["attention_mask"], objective.taps)
    # the teacher never builds [B, T, V] logits
    assert feats.logits is None and feats.greedy_ids is not None
    ref, ref_metrics, ref_scored = reference_loss(
        objective.module, lm_loss, batch, feats, 3, 0.8, 5
    )
    new = eagle3_ttt_loss(objective.module, lm_loss, batch, feats, 3, 0.8, 5)
    assert ref_scored > 0 and float(new.scored) == ref_scored
    torch.testing.assert_close(new.total, ref, rtol=0, atol=1e-5)
    assert set(new.metrics) == set(ref_metrics)
    for key, value in ref_metrics.items():
        torch.testing.assert_close(new.metrics[key], value.float(), rtol=0, atol=1e-5, msg=key)
    params = [p for p in objective.module.parameters() if p.requires_grad]
    for a, b in zip(torch.autograd.grad(ref, params), torch.autograd.grad(new.total, params)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_shift_left_and_the_reason_for_an_unscored_batch(target):
    x = torch.arange(10).view(2, 5)
    assert (
        shift_left(x, 2).tolist() == [[2, 3, 4, 0, 0], [7, 8, 9, 0, 0]]
        and shift_left(x, 9).sum() == 0
    )
    config = make_objective(target, draft_vocab=60).module.config
    assert unscored_reason(config, torch.tensor(3.0), torch.tensor(9.0)) is None
    # no assistant token: the mask's case
    assert unscored_reason(config, torch.tensor(0.0), torch.tensor(0.0)) is None
    assert "none of 9 assistant positions (drafter.draft_vocab_size=60" in unscored_reason(
        config, torch.tensor(0.0), torch.tensor(9.0)
    )
