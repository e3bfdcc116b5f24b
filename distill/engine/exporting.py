"""Export a trained drafter: from the live module at the end of training, or from a checkpoint / run
folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.common.constants import ADAPTER_LORA
from draftsmith.export.adapter import adapter_fingerprint, module_key_to_part_key
from draftsmith.export.format import MAIN_PART, ExportError, write_export

DRAFTER_PREFIX = "drafter."


def _compose_config(
    export_config: dict[str, Any],
    target: dict[str, Any],
    training: dict[str, Any],
    validation: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The export's config.json: the objective's blocks, the target identity, training facts, the
    base export a controller was trained on (``base_export``, checked when it loads), and the last
    served-tau probe of training (``validation``: served_tau, prompts, max_new_tokens, step, ...;
    see ``DistillModule.served_probe``).
    """
    config = {
        "method": export_config["method"],
        "architecture": export_config["architecture"],
        "target": target,
        "inference": export_config.get("inference", {}),
        "training": training,
    }
    if export_config.get("base_export"):
        config["base_export"] = export_config["base_export"]
    if validation:
        config["validation"] = validation
    return config


def split_parts(
    state: dict[str, torch.Tensor], export_config: dict[str, Any], target: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], dict]:
    """The module's state dict -> (main part, further parts, target identity) per
    ``export_config["weight_parts"]``.

    ``weight_parts`` (optional) maps a part name to ``{"prefix": <state-dict key prefix>, "kind":
    ...}``; keys are stored without the prefix. A ``kind: lora`` part (an adapter on the target)
    gets HF module-path keys (:mod:`draftsmith.export.adapter`) and the target identity gets
    ``adapter: {kind, fingerprint}`` of those weights, so the export is refused against a target
    without it. Without ``weight_parts``: one ``model`` part.
    """
    spec = export_config.get("weight_parts")
    if not spec:
        return state, {}, target
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, part in spec.items():
        prefix = part["prefix"]
        chosen = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if part.get("kind") == ADAPTER_LORA:
            chosen = {module_key_to_part_key(k): v for k, v in chosen.items()}
            target = {
                **target,
                "adapter": {"kind": ADAPTER_LORA, "fingerprint": adapter_fingerprint(chosen)},
            }
        parts[name] = chosen
    stray = [k for k in state if not any(k.startswith(p["prefix"]) for p in spec.values())]
    if stray or MAIN_PART not in parts:
        raise ExportError(
            f"weight_parts {sorted(spec)} must include {MAIN_PART!r} and cover every weight "
            f"(uncovered: {stray[:4]})"
        )
    main = parts.pop(MAIN_PART)
    return main, parts, target


def export_from_module(module: Any, out_dir: str | Path, training: dict[str, Any]) -> Path:
    """Export the live ``DistillModule``'s drafter (weights only; never the frozen target). An
    objective with its own ``write_export(out_dir, training)`` (diffusion_adapt: an ordinary HF
    model folder) writes it instead.
    """
    own = getattr(module.objective, "write_export", None)
    if callable(own):
        return Path(own(out_dir, training))
    state = {
        k: v.detach().float() if v.is_floating_point() else v
        for k, v in module.drafter.state_dict().items()
    }
    export_config = module.objective.export_config()
    main, parts, target = split_parts(state, export_config, module.run_info["target"])
    validation = getattr(module, "served_validation", None)
    return write_export(
        out_dir, main, _compose_config(export_config, target, training, validation), parts=parts
    )


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, or ``<run dir>/checkpoints/last.ckpt`` for a run folder."""
    path = Path(path)
    if path.is_file():
        return path
    candidate = path / "checkpoints" / "last.ckpt"
    if candidate.is_file():
        return candidate
    pointer = path / "checkpoints" / "last"  # written where the filesystem has no symlinks
    if pointer.is_file() and (path / "checkpoints" / pointer.read_text().strip()).is_file():
        return path / "checkpoints" / pointer.read_text().strip()
    raise ExportError(
        f"no checkpoint at {path}: pass a .ckpt file or a run folder holding checkpoints/last.ckpt"
    )


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a draftsmith training checkpoint without unpickling arbitrary objects
    (weights_only=True)."""
    ckpt_path = find_checkpoint(path)
    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises several types for corrupt files
        raise ExportError(
            f"cannot read checkpoint {ckpt_path} ({type(err).__name__}: {err}); "
            "it may be truncated: use an earlier checkpoint in the same folder"
        ) from err
    if "draftsmith" not in ckpt or "export_config" not in ckpt["draftsmith"]:
        raise ExportError(
            f"{ckpt_path} is not a draftsmith training checkpoint (no draftsmith metadata)"
        )
    return ckpt


def export_from_checkpoint(path: str | Path, out_dir: str | Path) -> Path:
    """Write a draftsmith export folder from a checkpoint file or run folder."""
    ckpt = load_checkpoint(path)
    meta = ckpt["draftsmith"]
    state = {
        k[len(DRAFTER_PREFIX) :]: v.float() if v.is_floating_point() else v
        for k, v in ckpt["state_dict"].items()
        if k.startswith(DRAFTER_PREFIX)
    }
    training = {
        "steps": int(ckpt.get("global_step", 0)),
        "tokens": int(meta.get("tokens_seen", 0)),
        "checkpoint": str(find_checkpoint(path)),
    }
    main, parts, target = split_parts(state, meta["export_config"], meta["target"])
    config = _compose_config(meta["export_config"], target, training, meta.get("validation"))
    return write_export(out_dir, main, config, parts=parts)
