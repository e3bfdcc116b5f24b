"""Hydra: sequentially dependent ("grounded") Medusa heads. Head k at position t reads the target's
post-norm hidden state h_t plus the embeddings of x_{t+1} .. x_{t+k+1} (teacher-forced with the real
tokens; at inference the root and the tokens drafted before it on its path) and predicts x_{t+k+2}.
Plain variant: MLP heads, dataset labels, heads summed unweighted (the paper). The export's tree is
calibrated from validation accuracies.

Hydra++ (the paper's best variant): a prefix-attention decoder layer over the context before the
heads, deeper heads (4 layers), dropout 0.2 and the target's own next-token distribution as the
teacher (soft labels: lm_loss_weight 0, teacher_loss_weight 1 in the reference;
conf/recipe/hydra_pp.yaml presets those labels and the paper's optimiser).

``python train.py recipe=hydra|hydra_pp``: the keys are :class:`Hydra`'s; the objective and its
build are in objective.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.distill.config.keys import group, key
from draftsmith.distill.config.schema import TrainConfig
from draftsmith.recipes.groups import TreeInferenceConfig
from draftsmith.recipes.registration import register_recipe

TESTS = ("tests/test_hydra.py", "tests/test_hydra_runtime.py")


@dataclass
class HydraHeadsConfig:
    num_heads: int = key("draft heads", 4, ge=1)
    num_layers: int = key("grounded block + (num_layers - 1) ResBlocks", 1, ge=1)
    dropout: float = key("dropout in the heads", 0.0, ge=0, lt=1)
    prefix_layer: bool = key(
        "Hydra++: a decoder layer attending over the context before the heads", False
    )
    share_lm_head: bool = key("reuse the frozen target LM head instead of one copy per head", False)
    decay: float = key(
        "per-head loss weight decay^(k+1) (the paper sums heads unweighted: 1)", 1.0, gt=0, le=1
    )
    topk_metric: int = key("k of the logged top-k accuracy", 5, ge=1)


@register_recipe(
    "hydra",
    label="Hydra",
    family="heads",
    module="heads/hydra.py",
    proposer="hydra",
    in_method_table=True,
    build=".objective:build",
    tests=TESTS,
)
@dataclass
class Hydra(TrainConfig):
    heads: HydraHeadsConfig = group(HydraHeadsConfig)
    inference: TreeInferenceConfig = group(TreeInferenceConfig)


@register_recipe(
    "hydra_pp",
    label="Hydra++",
    family="heads",
    module="heads/hydra.py",
    proposer="hydra_pp",
    in_method_table=True,
    build=".objective:build_pp",
    tests=("tests/test_hydra.py", "tests/test_head_family_train.py"),
)
@dataclass
class HydraPP(Hydra):
    heads: HydraHeadsConfig = group(HydraHeadsConfig, num_layers=4, dropout=0.2, prefix_layer=True)
