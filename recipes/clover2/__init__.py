"""Clover-2: a token-attention block (gated by per-head cosine similarity) merges the target's
pre-norm hidden state with the next token's embedding, an augmenting block of decoder layers
(initialised from the target's last layer) adapts it, and recurrent heads (the regressive
connection) draft one token each, every head feeding the next the token drafted before it. Loss per
head i: (feature_weight * SmoothL1 to the target's post-norm feature + token_weight * soft CE to its
distribution) * decay^i.

``python train.py recipe=clover2``: the keys are :class:`Clover2`'s; the objective and its build are
in objective.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.distill.config.keys import group, key
from draftsmith.distill.config.schema import TrainConfig
from draftsmith.recipes.groups import TreeInferenceConfig
from draftsmith.recipes.registration import register_recipe


@dataclass
class CloverHeadsConfig:
    num_heads: int = key("draft heads (tree depth; the paper: 5)", 4, ge=1)
    num_layers: int = key("augmenting decoder layers", 2, ge=1)
    embed_source: str = key(
        "embed: the target's input embedding | lm_head: its LM head (the paper; tied: the same)",
        "embed",
        choices=("embed", "lm_head"),
    )
    feature_weight: float = key("v_w: weight of the feature regression", 10.0, ge=0)
    token_weight: float = key("p_w: weight of the token loss", 1.0, ge=0)
    decay: float = key("per-head loss weight decay^i", 0.7, gt=0, le=1)
    topk_metric: int = key("k of the logged top-k accuracy", 5, ge=1)


@register_recipe(
    "clover2",
    label="Clover-2",
    family="heads",
    module="heads/clover.py",
    proposer="clover2",
    in_method_table=True,
    build=".objective:build",
    validate=".objective:validate",
    tests=("tests/test_clover.py", "tests/test_clover_runtime.py"),
)
@dataclass
class Clover2(TrainConfig):
    heads: CloverHeadsConfig = group(CloverHeadsConfig)
    inference: TreeInferenceConfig = group(TreeInferenceConfig)
