"""How the transformers fallback attends: the masks it builds itself (tree, window, per-layer
types), what it cannot verify exactly (one line), and a transformers config's sizes under the
runtime's names."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from draftsmith.runtime.target.interface import TargetSizes

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FULL, SLIDING = (
    "full_attention",
    "sliding_attention",
)  # transformers' layer types the fallback masks itself
MASKED_ATTENTION = ("eager", "sdpa")  # implementations that read a 4-D additive mask


@dataclass(frozen=True)
class FallbackAttention:
    """How a transformers causal LM attends, as far as the fallback's verification must reproduce
    it.

    The fallback's cache keeps every token of every layer, so it builds each forward's 4-D mask
    itself: the tree mask (or causal) over the new tokens, ANDed on windowed layers with the sliding
    window measured in positions (a tree node at depth d sees what plain decoding sees at position
    prefix + d). Models that mix full and windowed layers get a ``{layer_type: mask}`` dict, which
    their forward hands to each layer.
    """

    name: str
    windows: dict[int, int]  # layer index -> sliding window (tokens), as the model applies it
    layer_types: tuple[
        str, ...
    ]  # the mask keys the model reads (per-layer models); () = one mask for every layer
    refusal: str | None  # why trees cannot be verified exactly; None = they can

    @classmethod
    def of(cls, model: torch.nn.Module, base: torch.nn.Module) -> FallbackAttention:
        """Read the model's config and its backbone's forward (``base``, the module that runs:
        ``hf_forward.backbone``): its windows, whether it takes per-layer masks, what it cannot
        do."""
        cfg = model.config
        name = type(model).__name__.removesuffix("ForCausalLM")
        try:
            source = inspect.getsource(type(base).forward)
        except (OSError, TypeError):
            source = ""
        per_layer = (
            re.search(r"isinstance\((causal_mask_mapping := )?attention_mask, dict\)", source)
            is not None
        )
        types = tuple(getattr(cfg, "layer_types", None) or ())
        window = getattr(cfg, "sliding_window", None)
        windows: dict[int, int] = {}
        if window and "create_sliding_window_causal_mask" in source:
            layers = range(int(cfg.num_hidden_layers))
            windows = {
                i: int(window) for i in layers if not (per_layer and types) or types[i] == SLIDING
            }
        keys = tuple(sorted({FULL, SLIDING} | set(types))) if per_layer and types else ()
        return cls(name, windows, keys, _refusal(name, cfg, windows, keys, per_layer, types))

    def masks(
        self, p: int, pos: torch.Tensor, tree_mask: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive [1, 1, T, P+T] mask(s) for T new tokens at positions ``pos`` after ``p``
        committed slots (slot j holds position j); ``tree_mask`` [T, T] bool, None = causal."""
        t = pos.numel()
        allowed = torch.ones(t, p + t, dtype=torch.bool, device=pos.device)  # [T, P+T]
        own = tree_mask if tree_mask is not None else torch.ones(t, t, dtype=torch.bool).tril()
        allowed[:, p:] = own.to(pos.device)
        if not self.windows:
            return _additive(allowed, dtype)
        # [T, P+T] query - key
        gap = pos[:, None] - torch.cat([torch.arange(p, device=pos.device), pos])[None, :]
        sliding = allowed & (gap < next(iter(self.windows.values())))
        if not self.layer_types:
            return _additive(sliding, dtype)  # every layer has the window
        return {
            key: _additive(sliding if key == SLIDING else allowed, dtype)
            for key in self.layer_types
        }


def hf_sizes(cfg: PretrainedConfig) -> TargetSizes:
    """A transformers config's sizes under the runtime's names (GPT-2's ``n_layer`` and the like are
    mapped by transformers' ``attribute_map``; Falcon names its key/value heads
    ``num_kv_heads``)."""
    heads = int(cfg.num_attention_heads)
    kv = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_kv_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    context = getattr(cfg, "max_position_embeddings", None)
    return TargetSizes(
        int(cfg.num_hidden_layers),
        int(cfg.hidden_size),
        int(cfg.vocab_size),
        heads,
        int(kv),
        int(head_dim),
        None if context is None else int(context),
    )


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool [T, S] -> additive [1, 1, T, S] (0 where allowed, the dtype's minimum elsewhere)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def _refusal(
    name: str,
    cfg: object,
    windows: dict[int, int],
    keys: tuple[str, ...],
    per_layer: bool,
    types: tuple[str, ...],
) -> str | None:
    """One line naming the attention feature the fallback cannot verify trees through exactly, or
    None."""
    head = f"the transformers fallback cannot verify trees for {name}"
    tail = (
        "; serve it without --drafter (plain generation through the fallback is exact) or with"
        " --backend lean once the lean decoder supports it"
    )
    other = sorted(set(types) - {FULL, SLIDING})
    if other:
        return (
            f"{head} with {', '.join(other)} layers: the fallback builds full and sliding-window"
            f" masks only{tail}"
        )
    if getattr(cfg, "attention_chunk_size", None):
        return (
            f"{head} with chunked attention (chunks of {cfg.attention_chunk_size}): the fallback"
            f" does not chunk its tree masks{tail}"
        )
    if getattr(cfg, "alibi", False) or getattr(cfg, "model_type", "") in ("bloom", "mpt"):
        return (
            f"{head} with ALiBi position biases: they follow cache slots, not the tree's"
            f" positions{tail}"
        )
    impl = getattr(cfg, "_attn_implementation", None) or "eager"
    if impl not in MASKED_ATTENTION:
        return (
            f"{head} with attn_implementation={impl!r}: it ignores the tree's 4-D mask (use eager"
            f" or sdpa){tail}"
        )
    if windows and per_layer and not keys:
        layers = ",".join(str(i) for i in sorted(windows))
        return (
            f"{head} with a sliding window (layers {layers}: window"
            f" {next(iter(windows.values()))}): its config names no layer types to mask per"
            f" layer{tail}"
        )
    return None


__all__ = ["FULL", "MASKED_ATTENTION", "SLIDING", "FallbackAttention", "hf_sizes"]
