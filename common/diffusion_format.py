"""The block-diffusion format shared by training and serving: the spec a diffusion folder's
``config.json`` carries (``draftsmith_diffusion = {"block_length", "mask_token_id", "shift"}``), the
published families, and the block masks (bidirectional inside a block, causal across blocks; see
:mod:`draftsmith.runtime.target.diffusion_lm`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from draftsmith.common.errors import DraftsmithError

DIFFUSION_KEY = "draftsmith_diffusion"
MASK_TOKEN = "<|mask|>"


class DiffusionTargetError(DraftsmithError, ValueError):
    """A model or folder cannot be used as a block-diffusion target (one actionable message)."""


@dataclass(frozen=True)
class DiffusionSpec:
    """What makes a causal LM folder a block-diffusion target."""

    block_length: int
    mask_token_id: int
    shift: bool = True
    attention: str = (
        "block"  # "block": bidirectional in a block, causal across (ours); "full": the whole canvas
    )

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_length": self.block_length,
            "mask_token_id": self.mask_token_id,
            "shift": self.shift,
            "attention": self.attention,
        }


# model_type -> (mask token id when the config does not name one, shift). Block length is a decoding
# choice for these (LLaDA's evaluations and Learn2PD's filter use 32).
REMOTE_FAMILIES = {"llada": (126336, False), "dream": (151666, True)}
REMOTE_BLOCK_LENGTH = 32


def spec_of(config: Any, where: str = "the model") -> DiffusionSpec:
    """The diffusion spec recorded in a HF config (object or dict), or a known published family's
    (LLaDA, Dream); a causal LM gets a clear error."""
    raw = (
        config.get(DIFFUSION_KEY)
        if isinstance(config, dict)
        else getattr(config, DIFFUSION_KEY, None)
    )
    model_type = str(
        (
            config.get("model_type")
            if isinstance(config, dict)
            else getattr(config, "model_type", "")
        )
        or ""
    )
    if not raw and model_type.lower() in REMOTE_FAMILIES:
        default_mask, shift = REMOTE_FAMILIES[model_type.lower()]
        mask = (
            config.get("mask_token_id")
            if isinstance(config, dict)
            else getattr(config, "mask_token_id", None)
        )
        return DiffusionSpec(
            REMOTE_BLOCK_LENGTH, int(default_mask if mask is None else mask), shift, "full"
        )
    if not raw:
        raise DiffusionTargetError(
            f"{where} is a causal (autoregressive) LM, not a block-diffusion target: its config has"
            f" no {DIFFUSION_KEY!r} block. Adapt it first with `draftsmith train"
            " recipe=diffusion_adapt target=...` and pass the run's export folder"
        )
    if (
        str(raw.get("attention", "block")) != "block"
    ):  # "full" is only the remote families' (their code attends so)
        raise DiffusionTargetError(
            f"{where}: {DIFFUSION_KEY}.attention is {raw.get('attention')!r}; a draftsmith "
            "diffusion folder is block-causal ('block')"
        )
    return DiffusionSpec(
        int(raw["block_length"]), int(raw["mask_token_id"]), bool(raw.get("shift", True))
    )


def supports_prefix_cache(spec: DiffusionSpec) -> bool:
    """Whether finished blocks can be cached: block-causal attention (a finished block never reads a
    later one) and the shift (the next block's first slot is scored by the cached last position)."""
    return spec.attention == "block" and spec.shift


def block_ids(length: int, block_length: int, offset: int = 0, device: Any = None) -> torch.Tensor:
    """Block index of each position ``0..length-1``: ``(pos + offset) // block_length`` ->
    [length]."""
    return (torch.arange(length, device=device) + offset) // block_length


def prompt_offset(prompt_len: int, block_length: int) -> int:
    """The block offset that makes the first generated position start a block (prompt ends on a
    boundary)."""
    return (-prompt_len) % block_length


def block_causal_mask(
    q_blocks: torch.Tensor, k_blocks: torch.Tensor, k_valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Boolean attention mask [B, 1, Tq, Tk] (True = may attend) from block ids q [B, Tq] and k [B,
    Tk]."""
    allowed = k_blocks[:, None, :] <= q_blocks[:, :, None]  # [B, Tq, Tk]
    if k_valid is not None:
        allowed = allowed & k_valid[:, None, :].bool()
    return allowed[:, None]  # [B, 1, Tq, Tk]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = may attend) as the additive float mask every attention backend reads
    the same way (eager attention adds the mask to the scores, so a boolean one would be silently
    wrong there).
    """
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )
