"""Medusa-2: Medusa heads trained jointly with the target through LoRA adapters (needs the peft
extra: ``pip install 'draftsmith[peft]'``). ``L = adapter.lm_weight * L_LM + heads.coefficient *
sum_k decay^(k+1) CE_k``; the heads are warmed up alone first, then train at ``heads.lr_multiplier``
x ``optim.lr``. The export carries the heads and the adapter (merged into the target at load); it
changes the target, so it is lossy w.r.t. the original.

``python train.py recipe=medusa2``: the keys are :class:`Medusa2`'s; the objective and its build are
in objective.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.distill.config.keys import group, key
from draftsmith.distill.config.schema import TrainConfig
from draftsmith.recipes.groups import TreeInferenceConfig
from draftsmith.recipes.medusa import MedusaHeadsConfig
from draftsmith.recipes.registration import register_recipe


@dataclass
class Medusa2HeadsConfig(MedusaHeadsConfig):
    draft_vocab_size: int | None = key(
        "heads score only the N most frequent assistant tokens of the training data",
        None,
        ge=0,
        null="0 or null: the whole vocabulary",
    )
    coefficient: float = key(
        "lambda_0 (medusa_heads_coefficient): weight of the heads' loss", 0.2, gt=0
    )
    lr_multiplier: float = key(
        "heads LR = lr_multiplier x optim.lr (medusa_lr_multiplier)", 4.0, gt=0
    )
    warmup_steps: int = key(
        "heads-only steps before joint training (Medusa-2: heads first)", 20, ge=0
    )


@dataclass
class AdapterConfig:
    rank: int = key("LoRA rank", 8, ge=1)
    alpha: float = key("LoRA alpha", 16.0, gt=0)
    dropout: float = key("LoRA dropout", 0.0, ge=0, lt=1)
    target_modules: list[str] = key(
        "the target's linears that get adapters",
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        check=bool,
        allowed="one or more module names, e.g. [q_proj, v_proj]",
    )
    lm_weight: float = key("weight of the backbone's own loss", 1.0, ge=0)
    # the teacher is the same model with adapters disabled (use it with self-distilled data)
    self_distill: bool = key("backbone loss = KL(original target || adapted)", False)


# inference.verifier runs against the ADAPTED target: lossless w.r.t. it, lossy w.r.t. the original
@register_recipe(
    "medusa2",
    label="Medusa-2 (lossy)",
    family="heads",
    module="heads/medusa.py",
    proposer="medusa2",
    formats=("medusa", "medusa-tgi"),
    in_method_table=True,
    build=".objective:build",
    validate=".objective:validate",
    tests=("tests/test_medusa2.py", "tests/test_medusa2_runtime.py"),
)
@dataclass
class Medusa2(TrainConfig):
    heads: Medusa2HeadsConfig = group(Medusa2HeadsConfig)
    adapter: AdapterConfig = group(AdapterConfig)
    inference: TreeInferenceConfig = group(TreeInferenceConfig)
