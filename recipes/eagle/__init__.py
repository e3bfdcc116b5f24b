"""EAGLE-1: one decoder layer reads (the target's post-norm feature f_t, the embedding of x_{t+1})
and predicts f_{t+1}; the target's frozen LM head turns it into the distribution of x_{t+2}. ``L =
feature_weight * SmoothL1(f̂, f) + token_weight * soft-CE vs the target distribution``.

``python train.py recipe=eagle``: the keys are :class:`Eagle`'s (conf/recipe/eagle.yaml presets
EAGLE's optimiser: each gradient element clipped to [-0.5, 0.5]); the objective and its build are in
objective.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.distill.config.keys import group, key
from draftsmith.distill.config.schema import LossConfig, TrainConfig
from draftsmith.recipes.groups import DynamicTreeInferenceConfig
from draftsmith.recipes.registration import register_recipe


@dataclass
class EagleNoiseConfig:
    """Training-time noise added to the target features the drafter reads."""

    kind: str = key(
        "uniform: U(-scale, scale) per element (the paper) | none",
        "uniform",
        choices=("uniform", "none"),
    )
    scale: float = key(
        "the noise's half-width (the paper: 0.1, whatever the batch shape)", 0.1, ge=0
    )
    ref_len: int | None = key(
        "scale * ref_len / T for padded width T (EAGLE's code: 512, ~+-1 on short batches)",
        None,
        ge=1,
        null="independent of the batch shape",
    )


@dataclass
class EagleDrafterConfig:
    feature_weight: float = key("v_w: weight of the feature regression", 1.0, ge=0)
    token_weight: float = key("p_w: weight of the token loss", 0.1, ge=0)
    noise: EagleNoiseConfig = group(EagleNoiseConfig)
    noise_std: float | None = key(
        "older form of noise: (U(0,1) - 0.5) * noise_std * noise_ref_len / T",
        None,
        ge=0,
        null="use drafter.noise",
    )
    noise_ref_len: int | None = key(
        "older form of noise: see noise_std", None, ge=1, null="no length scaling"
    )
    topk_metric: int = key("k of the logged top-k accuracy", 5, ge=1)


@register_recipe(
    "eagle",
    label="EAGLE-1",
    family="drafter",
    module="drafters/eagle.py",
    proposer="eagle",
    in_method_table=True,
    build=".objective:build",
    validate=".objective:validate",
    tests=("tests/test_eagle.py", "tests/test_eagle_runtime.py", "tests/test_eagle_sampling.py"),
)
@dataclass
class Eagle(TrainConfig):
    drafter: EagleDrafterConfig = group(EagleDrafterConfig)
    loss: LossConfig = group(LossConfig)
    inference: DynamicTreeInferenceConfig = group(DynamicTreeInferenceConfig)
