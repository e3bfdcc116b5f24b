"""The toy method of docs/ADDING_A_METHOD.md: one linear head on the target's hidden state predicts
token t+2.

``python train.py recipe=toy``: the keys are :class:`Toy`'s; the objective and its build are in
objective.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.distill.config.keys import group, key
from draftsmith.distill.config.schema import TrainConfig
from draftsmith.recipes.registration import register_recipe


@dataclass
class ToyHeadConfig:
    bias: bool = key("give the head's linear layer a bias", False)


@register_recipe(
    "toy",
    label="Toy",
    family="heads",
    module="heads/toy.py",
    proposer="toy",
    build=".objective:build",
    tests=("tests/test_toy.py",),
)
@dataclass
class Toy(TrainConfig):
    head: ToyHeadConfig = group(ToyHeadConfig)
