"""Adaptive-temperature layer (LPO, arXiv 2411.09661): a head on the frozen target's hidden state
picks a sampling temperature from a grid, per response or per token; trained on chosen/rejected
pairs of ``draftsmith rollouts``.

``python train.py recipe=adaptive_temperature data=ROLLOUT_DIR
controller.granularity=sequence|token``: the keys are :class:`AdaptiveTemperature`'s
(conf/recipe/adaptive_temperature.yaml presets the data, optimiser and run lengths for preference
pairs); the objective, its build and the loop of rounds are in objective.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.distill.config.keys import group, key
from draftsmith.distill.config.schema import TrainConfig
from draftsmith.recipes.registration import CONTROLLER, register_recipe


@dataclass
class ControllerConfig:
    granularity: str = key(
        "token (AD_tok: a temperature per generated token) | sequence (AD_seq: one per response)",
        "token",
        choices=("token", "sequence"),
    )
    grid: list[float] | None = key(
        "temperature grid; must match the rollout folder's",
        None,
        null="the folder's (default 0.0..1.0 step 0.2)",
    )
    width: int = key("hidden width of the head's MLP", 128, ge=1)
    num_layers: int = key("Linear+SiLU blocks before the output layer (0 = linear head)", 1, ge=0)
    init: str | None = key(
        "a previous round's export to start from (later rounds: data=r1+r2 controller.init=R1)",
        None,
        null="a fresh head",
    )


@dataclass
class LpoConfig:
    form: str = key(
        "separate (the paper's Eq. 10) | joint (temperatures as tokens) | latent (as latents)",
        "separate",
        choices=("separate", "joint", "latent"),
    )
    beta: float = key(
        "DPO temperature of the logistic loss (not recovered from the paper)", 1.0, gt=0
    )
    reference: str = key(
        "joint/latent reference policy: uniform | a previous round's controller export", "uniform"
    )


@register_recipe(
    "adaptive_temperature",
    label="Adaptive temperature (LPO)",
    family="controller",
    module="controllers/adaptive_temperature.py",
    proposer=CONTROLLER,
    needs_input="rollouts",
    build=".objective:build",
    validate=".objective:validate",
    tests=("tests/test_lpo_controller.py", "tests/test_lpo_loss.py", "tests/test_lpo_rollouts.py"),
)
@dataclass
class AdaptiveTemperature(TrainConfig):
    controller: ControllerConfig = group(ControllerConfig)
    lpo: LpoConfig = group(LpoConfig)
