"""Export a trained drafter: from the live module at the end of training, or from a checkpoint / run folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.export.format import ExportError, write_export

DRAFTER_PREFIX = "drafter."


def _compose_config(export_config: dict[str, Any], target: dict[str, Any], training: dict[str, Any]) -> dict[str, Any]:
    return {"method": export_config["method"], "architecture": export_config["architecture"], "target": target,
            "inference": export_config.get("inference", {}), "training": training}


def export_from_module(module: Any, out_dir: str | Path, training: dict[str, Any]) -> Path:
    """Export the live ``DistillModule``'s drafter (weights only; never the frozen target)."""
    state = {k: v.detach().float() if v.is_floating_point() else v for k, v in module.drafter.state_dict().items()}
    config = _compose_config(module.objective.export_config(), module.run_info["target"], training)
    return write_export(out_dir, state, config)


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, or ``<run dir>/checkpoints/last.ckpt`` for a run folder."""
    path = Path(path)
    if path.is_file():
        return path
    candidate = path / "checkpoints" / "last.ckpt"
    if candidate.is_file():
        return candidate
    raise ExportError(f"no checkpoint at {path}: pass a .ckpt file or a run folder holding checkpoints/last.ckpt")


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a draftsmith training checkpoint without unpickling arbitrary objects (weights_only=True)."""
    ckpt_path = find_checkpoint(path)
    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises several types for corrupt files
        raise ExportError(f"cannot read checkpoint {ckpt_path} ({type(err).__name__}: {err}); "
                          "it may be truncated: use an earlier checkpoint in the same folder") from err
    if "draftsmith" not in ckpt or "export_config" not in ckpt["draftsmith"]:
        raise ExportError(f"{ckpt_path} is not a draftsmith training checkpoint (no draftsmith metadata)")
    return ckpt


def export_from_checkpoint(path: str | Path, out_dir: str | Path) -> Path:
    """Write a draftsmith export folder from a checkpoint file or run folder."""
    ckpt = load_checkpoint(path)
    meta = ckpt["draftsmith"]
    state = {k[len(DRAFTER_PREFIX):]: v.float() if v.is_floating_point() else v
             for k, v in ckpt["state_dict"].items() if k.startswith(DRAFTER_PREFIX)}
    training = {"steps": int(ckpt.get("global_step", 0)), "tokens": int(meta.get("tokens_seen", 0)),
                "checkpoint": str(find_checkpoint(path))}
    return write_export(out_dir, state, _compose_config(meta["export_config"], meta["target"], training))
