"""Resuming in a run folder whose checkpoint belongs to another model: one line naming what changed and the way out,
instead of Lightning's ``RuntimeError: Missing key(s) in state_dict`` after the target has loaded.

Two looks at the checkpoint (memory-mapped, so a large one costs little): before the target loads, the recipe it
was written by; once the objective is built, the weights' names and shapes against the module's. The config keys
that changed (from the config the checkpoint records) are named, so the user sees ``heads.num_heads 3 -> 5``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.common.errors import ConfigError

# Groups whose keys never change the weights' shapes (a resumed run may change them freely).
SHAPE_FREE_GROUPS = ("run", "validation", "optim", "data", "trainer", "logger", "inference", "loss", "distill")


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint, memory-mapped on the CPU (tensors are read only where touched); {} (nothing to compare) for
    a DeepSpeed checkpoint folder or a file torch cannot read, whose loading Lightning reports as before."""
    if not Path(path).is_file():
        return {}
    try:
        return torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
    except Exception:  # noqa: BLE001 - torch raises several types for damaged files; Lightning names them later
        return {}


def flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """``{"heads.num_heads": 3, ...}`` for a nested dict."""
    if not isinstance(node, dict):
        return {prefix.rstrip("."): node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(flat(value, f"{prefix}{key}."))
    return out


def changed_keys(saved: dict[str, Any], current: dict[str, Any], limit: int = 4) -> list[str]:
    """``key old -> new`` for the keys that may change the model (recipe, target, the recipe's own groups)."""
    old, new = flat(saved), flat(current)
    keys = [k for k in sorted(set(old) | set(new)) if k.split(".", 1)[0] not in SHAPE_FREE_GROUPS]
    return [f"{k} {old.get(k, '(unset)')} -> {new.get(k, '(unset)')}" for k in keys if old.get(k) != new.get(k)][:limit]


def way_out(run_dir: str | Path) -> str:
    return (f"start fresh in a new folder with hydra.run.dir=NEW_DIR, or start over in {run_dir} with "
            "run.resume=false")


def check_resume_recipe(checkpoint: dict[str, Any], ckpt_path: str, cfg: DictConfig, run_dir: str | Path) -> None:
    """Before the target loads: refuse a checkpoint another recipe wrote."""
    saved = checkpoint.get("draftsmith", {}).get("recipe")
    if saved is not None and saved != str(cfg.recipe.name):
        raise ConfigError(f"the run folder {run_dir} holds a recipe={saved} checkpoint ({ckpt_path}), and this run is "
                          f"recipe={cfg.recipe.name}: it cannot resume from it; {way_out(run_dir)}")


def check_resume_shapes(checkpoint: dict[str, Any], ckpt_path: str, cfg: DictConfig, module: torch.nn.Module,
                        run_dir: str | Path) -> None:
    """Once the model is built: refuse a checkpoint whose weights differ in names or shapes, naming the config keys
    that changed since it was written and the first differing weights."""
    if "state_dict" not in checkpoint:
        return
    theirs = {k: tuple(v.shape) for k, v in checkpoint["state_dict"].items()}
    mine = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    if theirs == mine:
        return
    saved_cfg = checkpoint.get("draftsmith", {}).get("config") or {}
    changes = changed_keys(saved_cfg, OmegaConf.to_container(cfg, resolve=True))
    weights = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
    shown = ", ".join(f"{k} {theirs.get(k, 'absent')} vs {mine.get(k, 'absent')}" for k in weights[:2])
    what = f"the model's shape changed ({'; '.join(changes)})" if changes else "the model's weights differ"
    raise ConfigError(f"cannot resume from {ckpt_path}: {what}; {len(weights)} weight(s) differ, e.g. {shown} "
                      f"(checkpoint vs this run); {way_out(run_dir)}")
