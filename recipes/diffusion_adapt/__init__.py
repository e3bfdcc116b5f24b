"""Adapt the target into a block-diffusion LM (BD3LM-style blocks, shift kept, MDLM 1/t masked CE).
The whole model trains (it is the objective's module); ``<run dir>/export`` is an ordinary HF folder
that ``target=`` / ``--target`` can name (``draftsmith diffusion-export`` converts exports written
in draftsmith's own format).

``python train.py recipe=diffusion_adapt``: the keys are :class:`DiffusionAdapt`'s
(conf/recipe/diffusion_adapt.yaml presets the short rows and small batches a whole-model update
needs); the objective and its build are in objective.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.distill.config.keys import group, key
from draftsmith.distill.config.schema import TrainConfig
from draftsmith.recipes.registration import register_recipe


@dataclass
class DiffusionConfig:
    block_length: int = key("tokens per diffusion block (Learn2PD's filter is 32 wide)", 32, ge=2)
    eps: float = key(
        "t ~ U(eps, 1): share of assistant tokens replaced by <|mask|>", 1.0e-3, gt=0, lt=1
    )
    eot_pad: int = key(
        "EoT slots appended to every row, counted in the loss (learn to pad after the end)",
        32,
        ge=0,
    )
    random_offset: bool = key(
        "random block phase per row (decoding aligns blocks to the prompt's end)", True
    )


@register_recipe(
    "diffusion_adapt",
    label="Diffusion adaptation",
    family="target-adaptation",
    module="recipes/diffusion_adapt/objective.py",
    proposer=None,
    needs_input="makes a target, not a drafter",
    build=".objective:build",
    tests=("tests/test_diffusion_adapt.py", "tests/test_diffusion_mask.py"),
)
@dataclass
class DiffusionAdapt(TrainConfig):
    diffusion: DiffusionConfig = group(DiffusionConfig)
