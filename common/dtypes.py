"""Dtype names accepted across draftsmith (configs, CLI flags, export configs): one table."""

from __future__ import annotations

import torch

from draftsmith.common.errors import InputError

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def dtype_from_name(name: str) -> torch.dtype:
    """``fp32`` / ``bf16`` / ``fp16`` (or torch spellings) -> torch dtype; ValueError listing the
    valid names."""
    key = str(name).lower().removeprefix("torch.")
    if key not in DTYPES:
        raise InputError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[key]
