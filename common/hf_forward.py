"""A transformers causal LM's own forward with its backbone's output captured: shared by training
(the target's features) and serving (the HF fallback, rollouts)."""

from __future__ import annotations

import inspect
from functools import cache

import torch

from draftsmith.common.errors import DraftsmithError


class BackboneNotRun(DraftsmithError, RuntimeError):
    """The module hooked for a causal LM's hidden states did not run in its forward."""


def backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The module a causal LM's forward really runs for its hidden states (``last_hidden_state``
    post final norm, ``hidden_states``): transformers' ``get_decoder()``, which follows wrappers
    (OPT: ``model.decoder``, the module ``OPTForCausalLM.forward`` calls, not ``model``); the
    ``base_model_prefix`` module for models without it.
    """
    get = getattr(model, "get_decoder", None)
    found = get() if callable(get) else None
    return (
        found
        if isinstance(found, torch.nn.Module)
        else getattr(model, model.base_model_prefix, model)
    )


@cache
def _parameters(forward_type: type) -> frozenset[str]:
    return frozenset(inspect.signature(forward_type.forward).parameters)


def cache_keyword(model: torch.nn.Module) -> str:
    """The name the model's forward takes its KV cache by: ``cache`` (transformers >= 5.x, where
    ``past_key_values`` is deprecated and goes away in 5.40) or ``past_key_values`` (older
    releases)."""
    return "cache" if "cache" in _parameters(type(model)) else "past_key_values"


def hf_forward(
    model: torch.nn.Module,
    base: torch.nn.Module | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **inputs: object,
) -> tuple[object, torch.Tensor]:
    """Run a transformers causal LM's own forward; return (its backbone's output, logits [B, T',
    V]).

    The logits come from the model's forward itself, so every model-specific LM-head post-processing
    (Gemma-2 final logit softcapping, Granite ``logits_scaling``, Cohere ``logit_scale``, a head
    bias, ...) applies exactly as in ``model(ids).logits``; re-applying ``lm_head`` to the hidden
    state would silently skip it. The backbone's output (``base``, default :func:`backbone`) is
    captured with a forward hook; a hook that never fires raises :class:`BackboneNotRun` naming both
    modules. A KV cache passed as ``past_key_values=`` or ``cache=`` goes to the model under the
    name its forward takes (:func:`cache_keyword`).
    ``logits_to_keep``: 0 = every position, ``n`` = the last ``n``, a 1-D LongTensor = those
    positions.
    """
    base = backbone(model) if base is None else base
    for name in ("past_key_values", "cache"):
        if name in inputs and name != cache_keyword(model):
            inputs[cache_keyword(model)] = inputs.pop(name)
    captured: list = []
    handle = base.register_forward_hook(lambda _m, _args, output: captured.append(output))
    native = "logits_to_keep" in _parameters(type(model))
    try:
        out = model(**inputs, logits_to_keep=logits_to_keep) if native else model(**inputs)
    finally:
        handle.remove()
    if not captured:
        raise BackboneNotRun(
            f"{type(model).__name__}'s forward never ran {type(base).__name__}, the module hooked"
            " for its hidden states; pass the module its forward calls"
            " (common.hf_forward.backbone)"
        )
    logits = out.logits  # [B, T', V]
    if not native and isinstance(
        logits_to_keep, torch.Tensor
    ):  # models without the argument return every row
        logits = logits.index_select(1, logits_to_keep.to(logits.device))
    elif not native and logits_to_keep:
        logits = logits[:, -int(logits_to_keep) :]
    return captured[-1], logits


__all__ = ["BackboneNotRun", "backbone", "cache_keyword", "hf_forward"]
