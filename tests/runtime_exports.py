"""Medusa exports for any saved target folder, made through the Medusa recipe itself (optionally
trained a few steps on a fixed batch): the runtime tests' way to get a real export for a target no
fixture covers."""

from __future__ import annotations

from pathlib import Path

import torch
from head_family_utils import fit_steps, fixed_batch, recipe_cfg


def medusa_export_for(
    folder: Path, tokenizer, out: Path, steps: int = 0
) -> tuple[Path, list[float]]:
    """(the export of 2 Medusa heads built by the recipe for the target in ``folder``, the losses of
    ``steps`` training steps on one fixed batch)."""
    from transformers import AutoModelForCausalLM

    from draftsmith.distill.target.frozen import Target
    from draftsmith.export.format import write_export
    from draftsmith.recipes import get_recipe

    target = Target(AutoModelForCausalLM.from_pretrained(folder), tokenizer, str(folder))
    torch.manual_seed(0)
    cfg = recipe_cfg("medusa", heads={"num_heads": 2}, inference={"tree_nodes": 6, "top_k": 4})
    objective = get_recipe("medusa").build(cfg, target)
    losses = (
        fit_steps(objective, target, fixed_batch(target.vocab_size, period=4), steps)
        if steps
        else []
    )
    config = {**objective.export_config(), "target": target.identity()}
    return write_export(out, objective.module.state_dict(), config), losses
