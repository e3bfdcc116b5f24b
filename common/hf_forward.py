"""A transformers causal LM's own forward with its base model's output captured: shared by training (the target's
features) and serving (the HF fallback, rollouts)."""

from __future__ import annotations

import inspect

import torch


def hf_forward(model: torch.nn.Module, base: torch.nn.Module, logits_to_keep: int | torch.Tensor = 0,
               **inputs: object) -> tuple[object, torch.Tensor]:
    """Run a transformers causal LM's own forward; return (its base model's output, logits [B, T', V]).

    The logits come from the model's forward itself, so every model-specific LM-head post-processing (Gemma-2
    final logit softcapping, Granite ``logits_scaling``, Cohere ``logit_scale``, a head bias, ...) applies exactly as in
    ``model(ids).logits``; re-applying ``lm_head`` to the hidden state would silently skip it. The base model's
    output (``last_hidden_state`` post final norm, ``hidden_states``) is captured with a forward hook.
    ``logits_to_keep``: 0 = every position, ``n`` = the last ``n``, a 1-D LongTensor = those positions.
    """
    captured: list = []
    handle = base.register_forward_hook(lambda _m, _args, output: captured.append(output))
    native = "logits_to_keep" in inspect.signature(model.forward).parameters
    try:
        out = model(**inputs, logits_to_keep=logits_to_keep) if native else model(**inputs)
    finally:
        handle.remove()
    logits = out.logits  # [B, T', V]
    if not native and isinstance(logits_to_keep, torch.Tensor):  # models without the argument return every row
        logits = logits.index_select(1, logits_to_keep.to(logits.device))
    elif not native and logits_to_keep:
        logits = logits[:, -int(logits_to_keep):]
    return captured[-1], logits
