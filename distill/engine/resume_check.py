"""Resuming in a run folder whose checkpoint belongs to another model, or to another training setup:
one line naming what changed and the way out, instead of Lightning's ``RuntimeError: Missing key(s)
in state_dict`` after the target has loaded, or a run that silently mixes two setups.

Two looks at the checkpoint (memory-mapped, so a large one costs little): before the target loads,
the recipe it was written by and the keys that set what the run trains on and how it steps
(:data:`TRAINING_GROUPS`: a changed ``optim.lr`` used to train at the checkpoint's rate while
``.hydra/config.yaml`` recorded the new one; a changed ``data=`` was mixed into the same run); once
the objective is built, the weights' names and shapes against the module's. The config keys that
changed (from the config the checkpoint records) are named, so the user sees ``heads.num_heads 3 ->
5``. ``run.resume=changed`` continues such a run on purpose, with the new values applied to the
restored optimizer (:class:`ApplyChangedOptim`); raising ``trainer.max_steps`` /
``trainer.max_time`` is how a run is extended and is always allowed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.common.errors import ConfigError

log = logging.getLogger(__name__)

# Groups whose keys never change the weights' shapes (a resumed run may change them freely).
SHAPE_FREE_GROUPS = (
    "run",
    "validation",
    "optim",
    "data",
    "trainer",
    "logger",
    "inference",
    "loss",
    "distill",
)
# Keys that set what a run trains on and how its optimizer steps: a resume that changed one is
# refused (unless run.resume=changed). The per-device batch and loader workers are free: the global
# batch rule keeps a run consistent across them (draftsmith.distill.cluster.attempts).
TRAINING_GROUPS = ("optim", "data", "distill")
TRAINING_KEYS = ("run.seed",)
FREE_KEYS = ("data.batch_size", "data.num_workers")


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint, memory-mapped on the CPU (tensors are read only where touched); {} (nothing
    to compare) for a DeepSpeed checkpoint folder or a file torch cannot read, whose loading
    Lightning reports as before.
    """
    if not Path(path).is_file():
        return {}
    try:
        return torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
    # torch raises several types for damaged files; Lightning names them later
    except Exception:  # noqa: BLE001
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
    """``key old -> new`` for the keys that may change the model (recipe, target, the recipe's own
    groups)."""
    old, new = flat(saved), flat(current)
    keys = [k for k in sorted(set(old) | set(new)) if k.split(".", 1)[0] not in SHAPE_FREE_GROUPS]
    return [
        f"{k} {old.get(k, '(unset)')} -> {new.get(k, '(unset)')}"
        for k in keys
        if old.get(k) != new.get(k)
    ][:limit]


def way_out(run_dir: str | Path) -> str:
    return (
        f"start fresh in a new folder with hydra.run.dir=NEW_DIR, or start over in {run_dir} with "
        "run.resume=false"
    )


def _same(old: Any, new: Any) -> bool:
    """Equal values, or two spellings of one existing file (``data=chat.jsonl`` and its absolute
    path)."""
    if old == new:
        return True
    if isinstance(old, str) and isinstance(new, str) and Path(old).expanduser().exists():
        return Path(old).expanduser().resolve() == Path(new).expanduser().resolve()
    return False


def changed_training_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key old -> new`` for the optimizer, data and labelling keys that differ (keys only one side
    has are skipped: a newer draftsmith may add keys)."""
    old, new = flat(saved), flat(current)
    keys = [
        k
        for k in sorted(set(old) & set(new))
        if k not in FREE_KEYS and (k.split(".", 1)[0] in TRAINING_GROUPS or k in TRAINING_KEYS)
    ]
    return [f"{k} {old[k]} -> {new[k]}" for k in keys if not _same(old[k], new[k])]


def check_resume_recipe(
    checkpoint: dict[str, Any], ckpt_path: str, cfg: DictConfig, run_dir: str | Path
) -> None:
    """Before the target loads: refuse a checkpoint another recipe wrote, or one written with other
    optimizer, data or labelling keys (unless ``run.resume=changed``)."""
    saved = checkpoint.get("draftsmith", {}).get("recipe")
    if saved is not None and saved != str(cfg.recipe.name):
        raise ConfigError(
            f"the run folder {run_dir} holds a recipe={saved} checkpoint ({ckpt_path}), and this"
            f" run is recipe={cfg.recipe.name}: it cannot resume from it; {way_out(run_dir)}"
        )
    step = int(checkpoint.get("global_step", 0) or 0)
    if step >= int(cfg.trainer.max_steps):
        log.warning(
            "the checkpoint %s is at step %d and trainer.max_steps=%d: nothing is left to train"
            " (raise trainer.max_steps to continue this run)",
            ckpt_path,
            step,
            int(cfg.trainer.max_steps),
        )
    saved_cfg = checkpoint.get("draftsmith", {}).get("config") or {}
    changes = changed_training_keys(saved_cfg, OmegaConf.to_container(cfg, resolve=True))
    if not changes:
        return
    if str(cfg.run.resume).lower() == "changed":
        log.warning(
            "resuming %s with changed training keys (run.resume=changed): %s",
            ckpt_path,
            "; ".join(changes),
        )
        return
    raise ConfigError(
        f"cannot resume {ckpt_path}: this run changes {'; '.join(changes)} (the checkpoint's"
        " optimizer state and data position belong to the values it was written with). Put them"
        f" back to resume; {way_out(run_dir)}; or continue this run with the new values:"
        " run.resume=changed"
    )


def check_resume_target(
    checkpoint: dict[str, Any], ckpt_path: str, target: Any, run_dir: str | Path
) -> None:
    """Once the target is loaded: refuse a checkpoint trained against another target (its tokenizer
    and LM head fingerprint differ; a copy of the same model in another folder passes), which used
    to resume silently when the shapes agreed."""
    saved = (checkpoint.get("draftsmith", {}).get("target") or {}).get("fingerprint")
    if not saved or target is None or not hasattr(target, "identity"):
        return
    now = target.identity()
    if now.get("fingerprint") not in (None, saved):
        was = checkpoint["draftsmith"]["target"].get("name_or_path")
        raise ConfigError(
            f"cannot resume {ckpt_path}: it was trained against the target {was} and this run's"
            f" target {now.get('name_or_path')} is another model (tokenizer and LM head"
            f" fingerprints {saved[:19]} vs {str(now['fingerprint'])[:19]}); point target= at the"
            f" model it was trained against, or {way_out(run_dir)}"
        )


def check_resume_shapes(
    checkpoint: dict[str, Any],
    ckpt_path: str,
    cfg: DictConfig,
    module: torch.nn.Module,
    run_dir: str | Path,
    target: Any = None,
) -> None:
    """Once the model is built: refuse a checkpoint trained against another ``target``
    (:func:`check_resume_target`), or whose weights differ in names or shapes, naming the config
    keys that changed since it was written and the first differing weights."""
    check_resume_target(checkpoint, ckpt_path, target, run_dir)
    if "state_dict" not in checkpoint:
        return
    theirs = {k: tuple(v.shape) for k, v in checkpoint["state_dict"].items()}
    mine = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    if theirs == mine:
        return
    saved_cfg = checkpoint.get("draftsmith", {}).get("config") or {}
    changes = changed_keys(saved_cfg, OmegaConf.to_container(cfg, resolve=True))
    weights = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
    shown = ", ".join(
        f"{k} {theirs.get(k, 'absent')} vs {mine.get(k, 'absent')}" for k in weights[:2]
    )
    what = (
        f"the model's shape changed ({'; '.join(changes)})"
        if changes
        else "the model's weights differ"
    )
    raise ConfigError(
        f"cannot resume from {ckpt_path}: {what}; {len(weights)} weight(s) differ, e.g. {shown} "
        f"(checkpoint vs this run); {way_out(run_dir)}"
    )


class ApplyChangedOptim(pl.Callback):
    """``run.resume=changed``: the optimizer's hyper-parameters (``lr``, betas, eps, weight decay)
    and the schedule's base rates come from this run's config, not from the checkpoint (whose
    optimizer state restores them). Read from the freshly configured optimizer before the restore,
    written back after it; the moments are kept.
    """

    def __init__(self) -> None:
        self.fresh: list[tuple[list[dict[str, Any]], list[float] | None]] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        schedulers = {id(c.scheduler.optimizer): c.scheduler for c in trainer.lr_scheduler_configs}
        self.fresh = [
            (
                [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
                list(getattr(schedulers.get(id(opt)), "base_lrs", None) or []) or None,
            )
            for opt in trainer.optimizers
        ]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.ckpt_path is None or not self.fresh:
            return
        schedulers = {id(c.scheduler.optimizer): c.scheduler for c in trainer.lr_scheduler_configs}
        for opt, (groups, base_lrs) in zip(trainer.optimizers, self.fresh):
            before = [g["lr"] for g in opt.param_groups]
            for group, fresh in zip(opt.param_groups, groups):
                group.update(fresh)
            scheduler = schedulers.get(id(opt))
            if scheduler is not None and base_lrs is not None:
                scheduler.base_lrs = list(base_lrs)
                lambdas = getattr(scheduler, "lr_lambdas", None) or [None] * len(base_lrs)
                for group, base, factor in zip(opt.param_groups, base_lrs, lambdas):
                    group["lr"] = (
                        base * factor(scheduler.last_epoch) if factor is not None else base
                    )
                scheduler._last_lr = [g["lr"] for g in opt.param_groups]
            log.info(
                "run.resume=changed: learning rate %s -> %s from this run's config",
                ", ".join(f"{v:.3g}" for v in before),
                ", ".join(f"{g['lr']:.3g}" for g in opt.param_groups),
            )
