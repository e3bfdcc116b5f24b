"""Learn2PD filter: an MLP over a diffusion block's confidences says which slots are already final;
BCE on oracle trajectories of a diffusion target.

``python train.py recipe=learn2pd target=DIFFUSION_FOLDER data=TRAJECTORY_DIR``: the keys are
:class:`Learn2PD`'s (conf/recipe/learn2pd.yaml presets full-batch training on the trajectory
folder); the objective and its build are in objective.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.distill.config.keys import group, key
from draftsmith.distill.config.schema import TrainConfig
from draftsmith.recipes.registration import CONTROLLER, register_recipe


@dataclass
class FilterConfig:
    hidden: int = key("hidden width of the MLP", 32, ge=1)
    num_layers: int = key(
        "MLP layers (the paper's 2; 1 = logistic regression, more conservative)", 2, ge=1
    )
    threshold: float = key(
        "acceptance threshold exported with the filter (the paper evaluates 0.9, serves 0.96)",
        0.9,
        gt=0,
        lt=1,
    )


@register_recipe(
    "learn2pd",
    label="Learn2PD",
    family="controller",
    module="controllers/learn2pd.py",
    proposer=CONTROLLER,
    needs_input="trajectories",
    build=".objective:build",
    validate=".objective:validate",
    tests=("tests/test_diffusion_learn2pd.py", "tests/test_diffusion_decode.py"),
)
@dataclass
class Learn2PD(TrainConfig):
    filter: FilterConfig = group(FilterConfig)
