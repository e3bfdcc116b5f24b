"""Helpers shared by the head-family tests (Hydra, Clover-2, Medusa-2): recipe configs, a fixed
batch, a tiny in-process target, and a few optimisation steps on one batch."""

import pytest
import torch
from recipe_configs import recipe_config


def recipe_cfg(name: str, **extra):
    """Recipe ``name``'s composed config (as train.py builds it) with ``extra`` groups merged in."""
    return recipe_config(name, extra, typed=False)


def fixed_batch(
    vocab: int, batch: int = 4, length: int = 16, seed: int = 0, period: int = 0
) -> dict[str, torch.Tensor]:
    """Random tokens (or, with ``period``, each row repeating ``period`` random tokens: learnable by
    a LM)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, period or length), generator=g)
    if period:
        ids = ids.repeat(1, -(-length // period))[:, :length]
    loss_mask = torch.ones(batch, length)
    loss_mask[:, :3] = 0
    attn = torch.ones(batch, length)
    attn[0, -3:] = 0  # one padded row
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask * attn}


def fit_steps(objective, target, batch, steps: int, lr: float = 3e-3) -> list[float]:
    """Train ``objective`` on one fixed batch; the losses before each step."""
    from draftsmith.distill.engine.objective import optimizer_groups

    opt = torch.optim.Adam(optimizer_groups(objective, lr))
    own = getattr(objective, "features", None)
    losses = []
    for step in range(steps):
        if hasattr(objective, "set_step"):
            objective.set_step(step)
        objective.module.train()
        feats = (
            own(target, batch)
            if callable(own)
            else target.features(batch["input_ids"], batch["attention_mask"], objective.taps)
        )
        loss, _ = objective.loss(batch, feats)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from draftsmith.distill.target.frozen import Target

    return Target(
        AutoModelForCausalLM.from_pretrained(tiny_target_dir), tiny_tokenizer, str(tiny_target_dir)
    )
