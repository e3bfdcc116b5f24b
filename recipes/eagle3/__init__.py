"""EAGLE-3: fuses the target's residual stream at the inputs of layers (2, L//2, L-3), one decoder
layer over concat(norm(embedding), norm(hidden)), its own LM head over a reduced draft vocabulary
(the most frequent assistant tokens of the training data), trained with training-time test (TTT):
ttt_steps unrolled steps on the drafter's own outputs, loss weight step_decay^j.

``python train.py recipe=eagle3``: the keys are :class:`Eagle3`'s (conf/recipe/eagle3.yaml presets
the optimiser of EAGLE-3's DeepSpeed config); the objective and its build are in objective.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.distill.config.keys import group, key
from draftsmith.distill.config.schema import LossConfig, TrainConfig
from draftsmith.recipes.groups import DynamicTreeInferenceConfig
from draftsmith.recipes.registration import register_recipe


@dataclass
class Eagle3DrafterConfig:
    target_layers: list[int] | None = key(
        "HF hidden_states indices fused (i = input of decoder layer i)",
        None,
        check=bool,
        allowed="one or more indices",
        null="(2, L//2, L-3)",
    )
    draft_vocab_size: int | None = key(
        "reduced draft vocabulary (EAGLE-3: 32k of Llama-3's 128k)",
        8192,
        ge=0,
        null="0 or null: the full vocabulary",
    )
    vocab_samples: int | None = key(
        "training conversations scanned for token frequencies", None, ge=1, null="the whole split"
    )
    init_lm_head_from_target: bool = key(
        "initialise the draft LM head from the target's rows", True
    )
    ttt_steps: int = key(
        "training-time-test steps unrolled (the paper: 7; 3 keeps CPU steps affordable)", 3, ge=1
    )
    step_decay: float = key("loss weight of TTT step j: step_decay^j", 0.8, gt=0, le=1)
    topk_metric: int = key("k of the logged top-k accuracy", 5, ge=1)


@dataclass
class Eagle3LossConfig(LossConfig):
    # on-policy replay (Eagle3Objective.replay): TTT's chain is the served chain, so only EAGLE-3
    # has the key
    replay_weight: float = key(
        "extra loss weight on the rows the served chain is rejected at (0 = off)", 0.0, ge=0
    )


@register_recipe(
    "eagle3",
    label="EAGLE-3",
    family="drafter",
    module="drafters/eagle3.py",
    proposer="eagle3",
    formats=("speculators", "sglang", "gguf"),
    in_method_table=True,
    build=".objective:build",
    tiny_overrides=("drafter.target_layers=[1,2,3]",),
    tests=("tests/test_eagle3.py", "tests/test_speculators_export.py"),
)
@dataclass
class Eagle3(TrainConfig):
    drafter: Eagle3DrafterConfig = group(Eagle3DrafterConfig)
    loss: Eagle3LossConfig = group(Eagle3LossConfig)
    inference: DynamicTreeInferenceConfig = group(DynamicTreeInferenceConfig)
