"""Medusa-1: K residual heads on the frozen target's last hidden state (post final norm); head k
predicts token t+k+2 with weight decay^(k+1). Each head has its own LM head initialised from the
target's (``heads.share_lm_head`` reuses the frozen target head instead: Medusa's "version 2"
layout).

``python train.py recipe=medusa``: the keys are :class:`Medusa`'s (``--help`` lists them); the
objective and its build are in objective.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.distill.config.keys import group, key
from draftsmith.distill.config.schema import LossConfig, TrainConfig
from draftsmith.recipes.groups import TreeInferenceConfig
from draftsmith.recipes.registration import register_recipe


@dataclass
class MedusaHeadsConfig:
    num_heads: int = key("draft heads (head k predicts token t+k+2)", 3, ge=1)
    num_layers: int = key("residual blocks per head", 1, ge=1)
    share_lm_head: bool = key("reuse the frozen target LM head instead of one copy per head", False)
    # The heads' LM heads are most of their cost: 8192 of SmolLM2's 49k columns make training ~3x
    # and drafting ~6x cheaper. A size at or above the vocabulary is the whole vocabulary (vLLM
    # reads either layout, ids as token_map).
    draft_vocab_size: int | None = key(
        "heads score only the N most frequent assistant tokens of the training data",
        8192,
        ge=0,
        null="0 or null: the whole vocabulary, Medusa's layout TGI reads",
    )
    vocab_samples: int | None = key(
        "training conversations scanned for the token counts", None, ge=1, null="the whole split"
    )
    decay: float = key("weight of head k: decay^(k+1)", 0.8, gt=0, le=1)
    topk_metric: int = key("k of the logged top-k accuracy", 5, ge=1)


@register_recipe(
    "medusa",
    label="Medusa-1",
    family="heads",
    module="heads/medusa.py",
    proposer="medusa",
    formats=("medusa", "medusa-tgi"),
    in_method_table=True,
    build=".objective:build",
    tests=(
        "tests/test_medusa.py",
        "tests/test_medusa_draft_vocab.py",
        "tests/test_integration_medusa.py",
    ),
)
@dataclass
class Medusa(TrainConfig):
    heads: MedusaHeadsConfig = group(MedusaHeadsConfig)
    loss: LossConfig = group(LossConfig)
    inference: TreeInferenceConfig = group(TreeInferenceConfig)
