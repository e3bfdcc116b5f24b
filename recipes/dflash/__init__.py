"""DFlash (z-lab design): a few non-causal decoder layers draft a whole block in ONE forward. The
target's residual stream at ``target_layers`` is concatenated and projected (fc + hidden_norm) and
injected as extra keys/values of every draft layer; the block is embed([verified token, mask *
(block_size-1)]) through the TARGET's embedding, and the TARGET's LM head (both shared, never saved)
drafts slots 1..block_size-1. Trained on ``anchors_per_seq`` random anchors per sequence against the
target's own distributions, position-weighted: w_k = position_decay^(k-1).

Defaults for the embedded target (SmolLM2-135M: 30 layers, hidden 576): block_size 8 (7 drafted
tokens per forward; a 2-core CPU verifies 8 tokens for little more than 1), 2 draft layers sized
like a target layer, 3 taps spread over
depth: target_layers null = (2, 15, 28) as HF hidden_states indices (z-lab target_layer_ids 1, 14,
27).

``python train.py recipe=dflash``: the keys are :class:`DFlash`'s; the objective is in
objective.py, its build in build.py (the mask token in mask_token.py), its training blocks in
blocks.py and the served confidence cut's search in cut.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.distill.config.keys import group, key
from draftsmith.distill.config.schema import LossConfig, TrainConfig
from draftsmith.recipes.registration import register_recipe


@dataclass
class DFlashDrafterConfig:
    block_size: int = key(
        "slots per block: the verified token + block_size-1 drafts (< data.max_length)", 8, ge=2
    )
    num_layers: int = key(
        "draft decoder layers (z-lab ships 1-8; 2 keeps CPU training affordable)", 2, ge=1
    )
    intermediate_size: int | None = key("MLP width", None, ge=1, null="the target's")
    target_layers: list[int] | None = key(
        "HF hidden_states indices injected",
        None,
        check=bool,
        allowed="one or more indices",
        null="num_taps spread over depth (z-lab's build_target_layer_ids, +1)",
    )
    num_taps: int = key("taps spread over depth when target_layers is null", 3, ge=1)
    mask_token_id: int | None = key(
        "the mask token",
        None,
        ge=0,
        null="first of pad / unk / special tokens absent from the training data",
    )
    mask_scan_samples: int | None = key(
        "conversations scanned for the mask-token check", None, ge=1, null="the whole split"
    )
    # slot-1 top-1 after 60 steps on an exact tiny target was 0.09 at 4, 0.47 at 16, 0.59 at 64 (the
    # setup of tests/test_dflash_served_slot1.py; SpecForge uses 512); each anchor adds block_size
    # drafter rows
    anchors_per_seq: int = key("random blocks per sequence per step", 64, ge=1)
    position_decay: float = key(
        "loss weight of slot k: position_decay^(k-1) (later slots count only if earlier accepted)",
        0.8,
        gt=0,
        le=1,
    )
    confidence_head: bool = key(
        "DSpark-style per-slot acceptance head (BCE); the export serves it at the best cut", False
    )
    confidence_weight: float = key("weight of the confidence head's BCE", 0.1, ge=0)
    markov_head: bool = key(
        "low-rank term from the previous slot's token (teacher-forced in training)", False
    )
    markov_rank: int = key("rank of the Markov head", 32, ge=1)
    topk_metric: int = key("k of the logged top-k accuracy", 5, ge=1)
    output_norm_init: float | None = key(
        "initial gain of the output norm",
        None,
        gt=0,
        null="min(1, 1/mean LM-head row norm): CE0 ~ ln V",
    )


@dataclass
class DFlashInferenceConfig:
    """The export's serving defaults (runtime/drafting/dflash.py)."""

    verifier: str = key(
        "greedy (lossless) | rejection (lossless sampling)",
        "greedy",
        choices=("greedy", "rejection"),
    )
    # 0 = off; > 0 needs drafter.confidence_head=true
    cut: float | None = key(
        "confidence cut: stop after the slot whose cumulative confidence falls below it",
        None,
        ge=0,
        lt=1,
        null="the cut validation finds best with a head (cut.py), off without one",
    )
    cut_token_cost: float = key(
        "what one more drafted token adds to a verify step, as a share of a step (2 CPU cores: "
        "~0.1)",
        0.1,
        ge=0,
    )


@register_recipe(
    "dflash",
    label="DFlash",
    family="drafter",
    module="drafters/dflash.py",
    proposer="dflash",
    formats=("dflash-zlab", "speculators", "gguf"),
    in_method_table=True,
    build=".build:build",
    validate=".objective:validate",
    tiny_overrides=("drafter.target_layers=[1,2,3]", "drafter.block_size=4"),
    tests=("tests/test_dflash.py", "tests/test_dflash_runtime.py"),
)
@dataclass
class DFlash(TrainConfig):
    drafter: DFlashDrafterConfig = group(DFlashDrafterConfig)
    loss: LossConfig = group(LossConfig)
    inference: DFlashInferenceConfig = group(DFlashInferenceConfig)
