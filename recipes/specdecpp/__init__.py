"""SpecDec++: an acceptance-prediction head on a frozen chain drafter (EAGLE-1, EAGLE-3 in chain
mode, Kangaroo). ``python train.py recipe=specdecpp drafter=EXPORT_DIR`` (train on target-generated
data: ``draftsmith regenerate``). The head reads the drafter's state of each drafted token and
predicts P(rejected | earlier tokens accepted); labels min(1, p_target/q_draft) of candidates
drafted during training; weighted soft BCE.

The keys are :class:`SpecDecPP`'s (conf/recipe/specdecpp.yaml presets the optimiser: short CPU runs
need more than the paper's 5e-5); the objective and its build are in objective.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.distill.config.keys import group, key
from draftsmith.distill.config.schema import TrainConfig
from draftsmith.recipes.registration import register_recipe


@dataclass
class SpecDecHeadConfig:
    num_layers: int = key("independent ResBlocks (the paper's best: 3)", 3, ge=1)
    reject_weight: float = key(
        "weight of the reject class in the soft BCE (the paper's weight_mismatch)", 6.0, gt=0
    )
    temperature: float = key(
        "draft / verify temperature of the labels (0 = greedy: [Z == argmax p])", 1.0, ge=0
    )
    mixing_ratio: float = key(
        "share of candidates replaced by the target's own token (the paper's r)", 0.15, ge=0, lt=1
    )
    mixed_in_loss: bool = key("count the labels of mixed positions (the paper ignores them)", False)


@dataclass
class SpecDecInferenceConfig:
    """The learned stop rule the export ships as its default."""

    threshold: float = key(
        "h: stop once P(some drafted token is rejected) > h (README: 0.3)", 0.3, gt=0, lt=1
    )
    min_depth: int = key(
        "drafted tokens before the head may stop (the paper's bounds [2, 20], scaled down)", 2, ge=1
    )
    max_depth: int = key("at most this many drafted tokens", 8, ge=1)
    verifier: str = key(
        "greedy (lossless) | rejection (lossless sampling)",
        "greedy",
        choices=("greedy", "rejection"),
    )


@register_recipe(
    "specdecpp",
    label="SpecDec++",
    family="controller",
    module="controllers/acceptance.py",
    proposer="specdecpp",
    needs_input="drafter=EXPORT",
    build=".objective:build",
    validate=".objective:validate",
    tests=("tests/test_specdecpp.py", "tests/test_specdecpp_stop_rule.py"),
)
@dataclass
class SpecDecPP(TrainConfig):
    drafter: str | None = key(
        "REQUIRED: the chain drafter export the head is trained on (its export references it)", None
    )
    head: SpecDecHeadConfig = group(SpecDecHeadConfig)
    inference: SpecDecInferenceConfig = group(SpecDecInferenceConfig)
