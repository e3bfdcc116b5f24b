"""Kangaroo self-drafter: the target's first ``exit_layer`` layers (shared, frozen) + one attention
block without MLP (+ its own norms) + the target's frozen LM head. Soft CE against the target's
distribution at the same position; logged ``accept`` = sum_v min(p, q), the expected acceptance of
one drafted token.

``python train.py recipe=kangaroo [drafter.exit_layer=2]``: the keys are :class:`Kangaroo`'s
(conf/recipe/kangaroo.yaml presets the optimiser: short CPU runs need more than the paper's 5e-5);
the objective and its build are in objective.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from draftsmith.distill.config.keys import group, key
from draftsmith.distill.config.schema import LossConfig, TrainConfig
from draftsmith.recipes.registration import register_recipe


def valid_exit_layer(value: Any) -> bool:
    """``auto`` or a whole number >= 1 (the target's depth bounds it once the target is loaded)."""
    return value in (None, "auto") or str(value).isdigit() and int(value) >= 1


@dataclass
class KangarooDrafterConfig:
    # auto: the paper's 2 of 32 layers (3 of 40) scaled to the target, ~depth/16 and >= 1
    exit_layer: Any = key(
        "shared target layers",
        "auto",
        check=valid_exit_layer,
        allowed="auto (~depth/16) or an integer >= 1 below the target's depth",
    )
    topk_metric: int = key("k of the logged top-k accuracy", 5, ge=1)


@dataclass
class KangarooInferenceConfig:
    """The runtime's defaults, stored in the export."""

    threshold: float = key(
        "stop drafting once the draft's top-1 probability < threshold (paper: 0.6, argparse 0.4)",
        0.6,
        gt=0,
        lt=1,
    )
    max_depth: int = key("gamma: at most this many drafted tokens per step (paper: 6)", 6, ge=1)
    verifier: str = key(
        "greedy (lossless) | rejection (lossless sampling)",
        "greedy",
        choices=("greedy", "rejection"),
    )


@register_recipe(
    "kangaroo",
    label="Kangaroo",
    family="self-speculative",
    module="drafters/kangaroo.py",
    proposer="kangaroo",
    in_method_table=True,
    build=".objective:build",
    tests=("tests/test_kangaroo.py",),
)
@dataclass
class Kangaroo(TrainConfig):
    drafter: KangarooDrafterConfig = group(KangarooDrafterConfig)
    loss: LossConfig = group(LossConfig)
    inference: KangarooInferenceConfig = group(KangarooInferenceConfig)
