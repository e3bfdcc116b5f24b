"""Write a block-diffusion LM as an ordinary HF folder carrying its diffusion spec (atomically)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.common.diffusion_format import DIFFUSION_KEY, DiffusionSpec


def save_diffusion_folder(
    model: torch.nn.Module,
    tokenizer: Any,
    spec: DiffusionSpec,
    out_dir: str | Path,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` + ``tokenizer`` as an ordinary HF folder carrying the diffusion spec (atomic:
    temp + rename)."""
    from draftsmith.export.format import atomic_folder_write

    setattr(model.config, DIFFUSION_KEY, {**spec.to_dict(), **(extra or {})})

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return atomic_folder_write(out_dir, fill)
