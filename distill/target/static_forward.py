"""What a target forward needs to stay static-shaped and sync-free: packed rows' document mask, and
the teacher's greedy ids without the [B, T, V] logits.

Packed rows (:mod:`draftsmith.distill.data.packing`) hold several conversations, each restarting its
positions; the target must not let a token attend across a document boundary.
:func:`document_attention_mask` is the 4-D additive mask HF attention takes as is (transformers
returns a prepared 4-D mask unchanged, so no padding check reads the mask back), causal inside each
document.

A plain LM head (:func:`plain_lm_head`: a bias-free linear layer, no logit softcapping or scaling)
lets EAGLE-3's teacher skip the vocabulary-wide logits: the greedy ids come from :func:`head_argmax`
in row chunks, and the teacher over the draft vocabulary from one [H, Nd] matmul
(:meth:`TargetFeatures.draft_logits`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Families whose logits are exactly lm_head(final_hidden) when the config asks for no
# post-processing.
PLAIN_HEAD_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo", "olmo2", "phi3"}
)
ARGMAX_CHUNK_BYTES = 1 << 28  # fp32 logits of one chunk of rows in head_argmax (256 MiB)


def document_attention_mask(document_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, T, T] (0 = attend, dtype's minimum = not) from ``document_ids`` [B, T]
    (-1 = padding): key ``s`` is visible to query ``t`` when ``s <= t`` and both are in the same
    document. A padding query sees itself only, so no row is empty and padding never reaches a real
    token."""
    length = document_ids.shape[1]
    index = torch.arange(length, device=document_ids.device)
    same = document_ids[:, :, None] == document_ids[:, None, :]  # [B, T, T]
    allowed = same & (index[None, :] <= index[:, None]) & (document_ids >= 0)[:, None, :]
    allowed = allowed | (index[None, :] == index[:, None])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=document_ids.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]  # [B, 1, T, T]


def plain_lm_head(model: nn.Module) -> bool:
    """Whether ``model``'s logits are exactly ``lm_head(final_hidden)``: a known family, a bias-free
    linear head and no softcapping / logit scaling in its config (others keep the model's own
    forward for their logits).
    """
    config = model.config
    head = model.get_output_embeddings()
    scaled = any(
        getattr(config, name, None) not in (None, 1, 1.0)
        for name in ("logits_scaling", "logit_scale")
    )
    return (
        getattr(config, "model_type", "") in PLAIN_HEAD_TYPES
        and isinstance(head, nn.Linear)
        and head.bias is None
        and not getattr(config, "final_logit_softcapping", None)
        and not scaled
    )


def head_argmax(
    hidden: torch.Tensor, weight: torch.Tensor, chunk_rows: int | None = None
) -> torch.Tensor:
    """``argmax(hidden @ weight.T, -1)`` for hidden [..., H] and weight [V, H], rows in chunks (a
    fixed count for a fixed shape): only one chunk's [rows, V] logits exist at a time. Returns [...]
    long."""
    flat = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    rows = chunk_rows or max(64, ARGMAX_CHUNK_BYTES // (4 * weight.shape[0]))
    parts = [
        F.linear(flat[start : start + rows], weight).argmax(-1)
        for start in range(0, flat.shape[0], rows)
    ]
    return torch.cat(parts).view(hidden.shape[:-1])


def forward_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    document_ids: torch.Tensor | None,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """Keyword arguments of the HF forward: packed rows (``document_ids``) get the 4-D document mask
    and their restarting positions; other batches their 2-D padding mask as before."""
    inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
    if document_ids is not None:
        inputs["attention_mask"] = document_attention_mask(document_ids, dtype)
    if position_ids is not None:
        inputs["position_ids"] = position_ids
    return inputs
