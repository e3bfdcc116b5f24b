"""Build the DFlash objective: the drafter sized like a target layer, reading the recipe's taps
(``drafter.target_layers`` or ``num_taps`` spread over depth), on the mask token resolved against
the training data (recipes/dflash/mask_token.py), with the export's ``inference`` block and, when
the drafter has a confidence head and ``inference.cut`` is null, the served cut's search
(recipes/dflash/cut.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from draftsmith.common.constants import STOP_FIXED
from draftsmith.common.errors import ConfigError
from draftsmith.distill.target.frozen import Target
from draftsmith.drafters.dflash import DFlashDrafter
from draftsmith.drafters.dflash_config import DFlashConfig, default_target_layers
from draftsmith.drafters.eagle import EagleConfig
from draftsmith.recipes.dflash import DFlash, DFlashDrafterConfig, DFlashInferenceConfig
from draftsmith.recipes.dflash.cut import CutSearch
from draftsmith.recipes.dflash.mask_token import resolve_mask_token
from draftsmith.recipes.dflash.objective import DFlashObjective
from draftsmith.recipes.lm_loss import lm_head_loss
from draftsmith.recipes.registration import untyped

log = logging.getLogger(__name__)


def resolve_taps(d: DFlashDrafterConfig, num_layers: int) -> tuple[int, ...]:
    """The target layers the drafter reads (HF ``hidden_states`` indices): ``drafter.target_layers``
    or ``num_taps`` spread over depth, refused in one line when the target lacks one."""
    try:
        layers = (
            tuple(d.target_layers)
            if d.target_layers
            else default_target_layers(num_layers, d.num_taps)
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(
            f"drafter.target_layers {list(layers)} names layer(s) {bad} the target lacks: it has "
            f"hidden_states 0..{num_layers - 1} (i = input of decoder layer i)"
        )
    return layers


def drafter_architecture(
    d: DFlashDrafterConfig,
    dims: dict[str, Any],
    vocab_size: int,
    layers: tuple[int, ...],
    mask_id: int,
) -> DFlashConfig:
    """The drafter's architecture: sized like a target layer (``dims``, from the target's HF
    config), with the recipe's block, taps, mask token and heads."""
    return DFlashConfig(
        hidden_size=dims["hidden_size"],
        intermediate_size=d.intermediate_size or dims["intermediate_size"],
        num_layers=d.num_layers,
        num_heads=dims["num_attention_heads"],
        num_kv_heads=dims["num_key_value_heads"],
        vocab_size=vocab_size,
        target_hidden_size=dims["hidden_size"],
        block_size=d.block_size,
        mask_token_id=mask_id,
        target_layers=layers,
        head_dim=dims["head_dim"],
        rms_norm_eps=dims["rms_norm_eps"],
        rope_theta=dims["rope_theta"],
        confidence_head=d.confidence_head,
        markov_head=d.markov_head,
        markov_rank=d.markov_rank,
    )


def inference_block(inf: DFlashInferenceConfig, block: int) -> dict[str, Any]:
    """The export's ``inference`` block: one block of ``block - 1`` drafts, cut at ``inference.cut``
    (null: 0, off until the cut validation finds the best one)."""
    return {
        "proposer": "dflash",
        "block_size": block,
        "depth": block - 1,
        "cut": 0.0 if inf.cut is None else inf.cut,
        "verifier": inf.verifier,
        "stop_policy": {"kind": STOP_FIXED},
    }


def build_objective(
    cfg: DFlash,
    target: Target,
    token_batches: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> DFlashObjective:
    """The objective; ``token_batches`` (iterable of (input_ids, loss_mask)) replaces the
    training-data scan."""
    from draftsmith.distill.data.draft_vocab import training_token_batches

    d = cfg.drafter
    layers = resolve_taps(d, target.num_layers)
    dims = EagleConfig.dims_from_hf(target.config)
    block = d.block_size
    if block >= dims["max_position_embeddings"]:
        raise ConfigError(
            f"drafter.block_size={block} is larger than the target's context "
            f"({dims['max_position_embeddings']} positions)"
        )
    batches = (
        token_batches
        if token_batches is not None
        else training_token_batches(untyped(cfg), target, d.mask_scan_samples)
    )
    mask_id = resolve_mask_token(
        d.mask_token_id, getattr(target, "tokenizer", None), target.vocab_size, batches
    )
    arch = drafter_architecture(d, dims, target.vocab_size, layers, mask_id)
    drafter = DFlashDrafter(arch, target.embed_weight.float(), target.lm_head_weight.float())
    if d.output_norm_init is not None:
        # a fixed gain, not the drafter's min(1, 1/mean|w_v|) (1.0 = old init)
        with torch.no_grad():
            drafter.norm.weight.fill_(d.output_norm_init)
    # null: the cut validation finds best (0 = off until then / without a head)
    auto_cut = cfg.inference.cut is None
    search = CutSearch(cfg.inference.cut_token_cost) if auto_cut and arch.confidence_head else None
    log.info(
        "DFlash: block %d, %d layers, taps %s, mask token %d",
        block,
        arch.num_layers,
        list(layers),
        mask_id,
    )
    return DFlashObjective(
        drafter,
        d.anchors_per_seq,
        d.position_decay,
        d.confidence_weight,
        d.topk_metric,
        inference_block(cfg.inference, block),
        lm_head_loss(cfg.loss),
        search,
    )


def build(cfg: DFlash, target: Target) -> DFlashObjective:
    """A DFlash drafter sized from the target, on its shared embedding and LM head."""
    return build_objective(cfg, target)
