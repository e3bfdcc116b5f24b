"""EAGLE-3 objectives on the tiny target, built through the shipped recipe (its schema and
conf/recipe/eagle3.yaml) with a draft vocabulary counted on fixed random batches: the EAGLE-3
drafter, training, acceptance-loss and packing tests share them."""

from __future__ import annotations

import torch
from recipe_configs import recipe_config

from draftsmith.distill.target.frozen import Target
from draftsmith.recipes.eagle3 import Eagle3
from draftsmith.recipes.eagle3 import objective as eagle3_recipe

LAYERS = (1, 2, 3)  # the tiny target has 4 layers: the default (2, L//2, L-3) needs L >= 7


def recipe_cfg(**drafter) -> Eagle3:
    """The shipped recipe's config (its schema and conf/recipe/eagle3.yaml) with drafter
    overrides."""
    return recipe_config("eagle3", {"drafter": {"target_layers": list(LAYERS), **drafter}})


def vocab_batches(vocab: int, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, 40), generator=g)
        ids[:, ::3] = 7  # token 7 is the most frequent assistant token
        out.append((ids, torch.ones_like(ids)))
    return out


def make_objective(
    target: Target, draft_vocab: int = 48, **drafter
) -> eagle3_recipe.Eagle3Objective:
    torch.manual_seed(0)
    cfg = recipe_cfg(draft_vocab_size=draft_vocab, **drafter)
    objective = eagle3_recipe.build_objective(cfg, target, vocab_batches(target.vocab_size))
    objective.module.eval()
    return objective


def fixed_batch_steps(objective, target: Target, steps: int = 20) -> tuple[list[float], list[dict]]:
    """``steps`` AdamW steps of ``objective`` on one fixed random batch: (losses, metrics of each
    step)."""
    objective.module.train()
    torch.manual_seed(0)
    ids = torch.randint(5, target.vocab_size, (4, 20))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
    }
    feats = target.features(ids, batch["attention_mask"], objective.taps)
    opt = torch.optim.AdamW(objective.module.parameters(), lr=3e-3)
    losses, metrics = [], []
    for _ in range(steps):
        loss, step_metrics = objective.loss(batch, feats)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        metrics.append(step_metrics)
    return losses, metrics
