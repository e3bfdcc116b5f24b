"""DFlash exports of random weights for the tiny Llama target, as the DFlash export, engine and
DSpark tests build them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from conftest import build_tiny_llama
from recipe_configs import recipe_config

from draftsmith.distill.engine.exporting import export_from_module
from draftsmith.distill.target.frozen import Target
from draftsmith.recipes.dflash.build import build_objective

TAPS = [1, 2, 3]  # hidden_states indices of the 4-layer tiny target


def tiny_llama_target(tokenizer) -> Target:
    """The frozen tiny Llama (4 layers) over ``tokenizer``'s vocabulary."""
    return Target(build_tiny_llama(len(tokenizer)), tokenizer, "tiny")


def export_dflash(
    target: Target,
    out: Path,
    layers: list[int] | None = TAPS,
    block: int = 4,
    heads: bool = False,
    num_layers: int = 2,
    norms: bool = True,
) -> tuple[Path, object]:
    """A DFlash export of random weights for ``target`` (every weight perturbed, so equality tests
    can fail; ``norms=False`` keeps the RMSNorm weights at 1, which makes the drafts depend on the
    context taps).
    """
    torch.manual_seed(0)
    cfg = recipe_config(
        "dflash",
        {
            "drafter": {
                "target_layers": layers,
                "block_size": block,
                "num_layers": num_layers,
                "confidence_head": heads,
                "markov_head": heads,
                "mask_token_id": None,
            }
        },
    )
    g = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randint(4, target.vocab_size, (2, 30), generator=g),
            torch.ones(2, 30, dtype=torch.long),
        )
    ]
    objective = build_objective(cfg, target, batches)
    for p in objective.module.parameters():
        if norms or p.dim() > 1:
            p.data.normal_(0, 0.1)
    module = SimpleNamespace(
        drafter=objective.module, objective=objective, run_info={"target": target.identity()}
    )
    return export_from_module(module, out, training={}), objective.module
