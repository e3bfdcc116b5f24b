"""Serving an export that changes its target (Medusa-2: a LoRA trained jointly with the heads): the
adapter part is merged into the target's weights at load, and the target's identity then names the
adapter it carries.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from draftsmith.common.constants import ADAPTER_LORA

WeightTransform = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def target_adapter(
    export_dir: str | Path, config: dict[str, Any]
) -> tuple[WeightTransform, dict[str, str]] | None:
    """For an export whose target record names an adapter: (a function merging it into HF-named
    target weights, the identity block ``{"kind", "fingerprint"}`` the merged target carries). None
    for an export without one.
    """
    recorded = (config.get("target") or {}).get("adapter")
    if not recorded:
        return None
    from draftsmith.export.adapter import adapter_fingerprint, merge_lora
    from draftsmith.export.format import ExportError, read_export_parts

    block = (config.get("inference") or {}).get("adapter") or {}
    if block.get("kind", recorded.get("kind")) != ADAPTER_LORA:
        raise ExportError(
            f"{export_dir}: the target adapter kind {block.get('kind')!r} cannot be applied by this"
            " runtime (it merges LoRA adapters)"
        )
    _, parts = read_export_parts(export_dir)
    part = parts.get(block.get("part", "adapter"))
    if part is None:
        raise ExportError(
            f"{export_dir}: the export names a target adapter but has no "
            f"{block.get('part', 'adapter')!r} part; re-export the drafter"
        )
    scaling = (
        float(block["scaling"])
        if "scaling" in block
        else float(block["alpha"]) / float(block["rank"])
    )
    return (lambda weights: merge_lora(weights, part, scaling)), {
        "kind": ADAPTER_LORA,
        "fingerprint": adapter_fingerprint(part),
    }
