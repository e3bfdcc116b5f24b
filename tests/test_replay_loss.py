"""On-policy error-position replay for EAGLE-3 (loss.replay_weight, Eagle3Objective.replay in
recipes/eagle3/)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_llama
from eagle3_objectives import LAYERS, fixed_batch_steps, make_objective
from omegaconf import OmegaConf
from test_eagle3_training import two_step_setup

from draftsmith.common.errors import ConfigError
from draftsmith.distill.losses.core import LMHeadLoss
from draftsmith.distill.target.frozen import Target, TargetFeatures

pytestmark = pytest.mark.unit


@pytest.fixture()
def target(tiny_tokenizer) -> Target:
    return Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")


def chain_logits(
    drafter, fused: torch.Tensor, ids: torch.Tensor, b: int, t: int
) -> list[torch.Tensor]:
    """The drafter's logits at steps 0 and 1 of the chain that starts after position t+1 (step 1 fed
    the true token, as TTT does and as serving does once step 0 was accepted)."""
    hidden, step0, cache = drafter.draft_step(
        drafter.fuse(fused[b : b + 1, : t + 1]), ids[b : b + 1, 1 : t + 2]
    )
    _, step1, _ = drafter.draft_step(hidden[:, -1:], ids[b : b + 1, t + 2 : t + 3], cache)
    return [step0[0, -1], step1[0, -1]]


def target_logits(
    chains: dict, draft_ids: torch.Tensor, g: torch.Generator, shape: tuple[int, int, int]
) -> torch.Tensor:
    """Random target logits [B, T, V] whose argmax is draftable everywhere, made to agree with the
    drafter's step-0 proposal on half the chains and with its step-1 proposal on a quarter."""
    B, T, V = shape
    logits = torch.randn(B, T, V, generator=g)
    best = draft_ids[torch.randint(0, 60, (B, T), generator=g)]
    # a draftable target argmax everywhere
    logits.scatter_add_(-1, best[..., None], torch.full((B, T, 1), 8.0))
    for (b, t), (step0, step1) in chains.items():
        if t % 2 == 0:  # half the chains: the target agrees with the drafter's step-0 proposal ...
            logits[b, t + 1, draft_ids[step0.argmax()]] += 30.0
            if t % 4 == 0:  # ... and a quarter of them at step 1 too
                logits[b, t + 2, draft_ids[step1.argmax()]] += 60.0
    return logits


def drafter_step_logits(drafter, fused, ids, chains: dict, b: int, t: int, j: int) -> torch.Tensor:
    """The drafter's logits at step j of the chain after position t+1 (step 0 computed afresh for
    the rows too late in the sequence to have a two-step chain)."""
    if (b, t) in chains:
        return chains[(b, t)][j]
    return drafter.draft_step(drafter.fuse(fused[b : b + 1, : t + 1]), ids[b : b + 1, 1 : t + 2])[
        1
    ][0, -1]


def reference_replay_steps(drafter, fused, ids, chains, logits, loss_mask, weight, draft_ids):
    """Per step j, (loss, rejected rows, rows) by the reference rule, and the chains whose step 0
    was accepted."""
    B, T = ids.shape
    steps, accepted_step0 = [], set()
    for j in range(2):
        terms, rejected = [], 0
        for b in range(B):
            for t in range(T - 2 - j):
                if not loss_mask[b, t + 2 + j]:
                    continue
                p = F.softmax(logits[b, t + 1 + j, draft_ids], -1)
                step_logits = drafter_step_logits(drafter, fused, ids, chains, b, t, j)
                ce = -(p * F.log_softmax(step_logits, -1)).sum()
                right = bool(step_logits.argmax() == p.argmax())
                exposed = j == 0 or (b, t) in accepted_step0
                if j == 0 and right:
                    accepted_step0.add((b, t))
                rejected += exposed and not right
                terms.append(ce * (1 + weight * (exposed and not right)))
        steps.append((torch.stack(terms).mean(), rejected, len(terms)))
    return steps, accepted_step0


def test_replay_weights_exactly_the_rows_the_served_chain_stops_at(target):
    """Reference: per chain, step 0 rejected when its greedy draft token is not the target's; step 1
    counts only for chains whose step 0 was accepted. Loss per step = (1/M) sum (1 + w * rejected) *
    softCE."""
    objective, g, ids, layers = two_step_setup(target, 10)
    drafter = objective.module
    B, T, V = 2, 10, target.vocab_size
    fused = torch.cat([layers[i] for i in LAYERS], -1)
    draft_ids = drafter.draft_ids_in_target()
    with torch.no_grad():
        chains = {
            (b, t): chain_logits(drafter, fused, ids, b, t) for b in range(B) for t in range(T - 3)
        }
    logits = target_logits(chains, draft_ids, g, (B, T, V))
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :2] = 0
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
    feats = TargetFeatures(layer_hidden=layers, logits=logits)

    for weight in (0.0, 2.5):
        objective.lm_loss = LMHeadLoss(replay_weight=weight)
        loss, metrics = objective.loss(batch, feats)
        steps, accepted_step0 = reference_replay_steps(
            drafter, fused, ids, chains, logits, loss_mask, weight, draft_ids
        )
        total = 0.0
        for j, (step_loss, rejected, rows) in enumerate(steps):
            torch.testing.assert_close(
                metrics[f"step{j}/loss"], step_loss.detach(), atol=1e-5, rtol=0
            )
            torch.testing.assert_close(
                float(metrics[f"step{j}/rejected"]), rejected / rows, atol=1e-6, rtol=0
            )
            total = total + 0.8**j * step_loss
        torch.testing.assert_close(loss, total, atol=1e-5, rtol=0)
        # the construction gives every kind of row: accepted and rejected at step 0, exposed and not
        # at step 1
        assert 0 < len(accepted_step0) < B * (T - 2) and 0 < steps[1][1] < len(accepted_step0)


def test_replay_training_lowers_the_loss_and_the_rejections(tiny_tokenizer):
    target = Target(
        build_tiny_llama(len(tiny_tokenizer), initializer_range=0.2), tiny_tokenizer, "tiny"
    )
    objective = make_objective(target)
    objective.lm_loss = LMHeadLoss(replay_weight=1.0)
    losses, metrics = fixed_batch_steps(objective, target)
    assert losses[-1] < 0.75 * losses[0], losses
    assert float(metrics[-1]["step0/rejected"]) < float(metrics[0]["step0/rejected"]) - 0.2


def test_replay_weight_is_checked_and_refused_where_no_chain_defines_it():
    def cfg(recipe: str, weight: float):
        return OmegaConf.create({"recipe": {"name": recipe}, "loss": {"replay_weight": weight}})

    assert LMHeadLoss.from_config(cfg("eagle3", 1.5), replay=True).replay_weight == 1.5
    with pytest.raises(ConfigError, match=r"loss.replay_weight must be >= 0"):
        LMHeadLoss.from_config(cfg("eagle3", -1.0), replay=True)
    with pytest.raises(ConfigError, match=r"only recipe=eagle3 .*loss.replay_weight=0 for medusa"):
        LMHeadLoss.from_config(cfg("medusa", 1.0))
    assert LMHeadLoss.from_config(cfg("medusa", 0.0)).replay_weight == 0.0
