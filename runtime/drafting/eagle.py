"""The EAGLE-1 / EAGLE-3 family: builds an :class:`~draftsmith.runtime.drafting.eagle_proposer.
EagleProposer` from an export folder (the drafter placed where the target runs, the tree sizes from
the export's ``inference`` block and the user's options) and says how it drafts a plain chain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.common.errors import InputError
from draftsmith.drafters.eagle import EagleDrafter
from draftsmith.drafters.eagle3 import Eagle3Drafter
from draftsmith.export.format import TargetMismatchError
from draftsmith.runtime.drafting.eagle_adapters import Eagle1DraftModel, Eagle3DraftModel
from draftsmith.runtime.drafting.eagle_models import DraftModel
from draftsmith.runtime.drafting.eagle_proposer import EagleProposer
from draftsmith.runtime.drafting.registry import register_chain, register_proposer
from draftsmith.runtime.target.fast_linear import accelerate_linears
from draftsmith.runtime.target.interface import TargetDecoder


def _proposer(config: dict, model: DraftModel, options: dict[str, Any]) -> EagleProposer:
    """Tree sizes from the export's ``inference`` block, overridden by ``options``."""
    valid = {"policy", "total_tokens", "depth", "top_k", "temperature", "top_p"}
    if unknown := sorted(set(options) - valid):
        raise InputError(
            f"unknown option(s) {unknown} for the {config['method']} proposer; valid:"
            f" {sorted(valid)}"
        )
    draft_vocab = model.vocab_size if model.draft_ids is None else int(model.draft_ids.numel())
    ranges = {
        "total_tokens": (2, None, "tree nodes: the root and at least one drafted token"),
        "depth": (0, None, "drafter forwards after the root step"),
        "top_k": (1, draft_vocab, "draft vocabulary"),
    }
    for key, (low, high, what) in ranges.items():
        value = options.get(key)
        if value is not None and (
            not isinstance(value, int) or value < low or (high is not None and value > high)
        ):
            span = f"in {low}..{high}" if high is not None else f">= {low}"
            raise InputError(
                f"--proposer-option {key}={value!r} is out of range: an integer {span} ({what})"
            )
    inference = config.get("inference") or {}
    kw = {
        "policy": inference.get("proposer", "tree"),
        "total_tokens": inference.get("total_tokens", 16),
        "depth": inference.get("depth", 4),
        "top_k": inference.get("top_k", 4),
    }
    kw.update({k: v for k, v in options.items() if v is not None})
    return EagleProposer(model, **kw)


def _place(drafter: torch.nn.Module, target_model: TargetDecoder) -> torch.nn.Module:
    """Run the drafter where and in the precision the target runs (bf16 CPU linears through the
    packed kernel)."""
    w = target_model.lm_head_weight
    drafter = drafter.to(device=w.device, dtype=w.dtype).eval()
    accelerate_linears(drafter)
    return drafter


@register_chain("eagle")
@register_chain("eagle3")
def _eagle_chain(tokens: int) -> dict[str, Any]:
    """The EAGLE chain policy: ``depth + 1`` drafted tokens (see the module docstring)."""
    return {"policy": "chain", "depth": tokens - 1}


@register_proposer("eagle")
def _build_eagle(
    export_dir: str | Path, config: dict, target_model: TargetDecoder, **options: Any
) -> EagleProposer:
    """EAGLE-1 proposer; options: policy ("tree" | "chain"), total_tokens, depth, top_k,
    temperature, top_p.

    The target was already checked against the export by ``build_proposer`` (the only caller)."""
    drafter, _ = EagleDrafter.from_export(
        export_dir,
        embed_weight=target_model.embed_weight,
        lm_head_weight=target_model.lm_head_weight,
    )
    # the same weights through the target's fast linears; its packed head (C++ ops) shared by the
    # native top-k
    model = Eagle1DraftModel(
        _place(drafter, target_model), target_model.lm_head_logits, target_model.packed_head
    )
    return _proposer(config, model, options)


@register_proposer("eagle3")
def _build_eagle3(
    export_dir: str | Path, config: dict, target_model: TargetDecoder, **options: Any
) -> EagleProposer:
    """EAGLE-3 proposer (same options); the loop requests its layer taps from every target forward
    (the lean decoder and the HF fallback both return them)."""
    layers = [int(i) for i in config["architecture"].get("target_layers", [])]
    num_layers = target_model.sizes.num_layers
    if any(not 0 <= i < num_layers for i in layers):
        raise TargetMismatchError(
            f"the eagle3 drafter taps target layers {layers}, outside 0..{num_layers - 1} of "
            "the loaded target; use the target it was trained for"
        )
    drafter, _ = Eagle3Drafter.from_export(export_dir, embed_weight=target_model.embed_weight)
    return _proposer(config, Eagle3DraftModel(_place(drafter, target_model)), options)
