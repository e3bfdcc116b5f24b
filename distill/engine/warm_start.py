"""Warm start (``run.init_from=EXPORT``): a fresh run whose drafter starts from a shipped export's
weights, with a new warm-up (fresh optimizer state and LR schedule) and the same data order
continued, so tokens accumulate across sittings and machines instead of every sitting starting from
zero.

- The export must hold the same method and architecture as the run builds, for the same target (its
  identity: vocabulary, hidden size, layers, tokenizer and LM-head fingerprints); anything else is
  refused in one line before training. Its weights are loaded into the freshly built drafter (stored
  bf16 weights are upcast into the drafter's own dtype).
- The export's record (``training.lineage``, written by every run) says which data order it trained
  on (data spec, limit, length, batch, split, packing, seed, global batch) and how many optimizer
  steps of that order it took in all. When this run's order is the same, the data module skips those
  batches (:func:`continue_data_order`, called by it), so the first batch is the one after the last
  the export saw; another order starts at its beginning.
- The record accumulates: total steps, tokens, wall and CPU seconds across warm starts, and one
  entry per run with its command, the machines it ran on and its sittings (a process that ran the
  run: ``sittings.json`` in the run folder, written at each sitting's end, Ctrl-C and SIGTERM
  included; a ``kill -9`` loses that sitting's seconds, never its steps or tokens, which come from
  the checkpoint).

What the fresh start read is kept in ``<run dir>/warm_start.json`` (written atomically), so a
resumed run continues the same record even if the export has since been replaced; a damaged one is
refused in one line.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from draftsmith.common.errors import ConfigError
from draftsmith.distill.data.resumable import batches_done_in_epoch

log = logging.getLogger(__name__)

WARM_FILE, SITTINGS_FILE = "warm_start.json", "sittings.json"


def data_order(cfg: Any, world: int | None = None) -> dict[str, Any]:
    """What fixes the sequence of global batches a run trains on (two runs with equal records see
    the same batches);
    ``world``: the processes training (default: what ``cfg.trainer`` plans)."""
    from draftsmith.distill.cluster.attempts import planned_world_size

    world = planned_world_size(cfg.trainer) if world is None else world
    data = cfg.data
    return {
        "spec": str(data.spec),
        "limit": data.limit,
        "max_length": int(data.max_length),
        "batch_size": int(data.batch_size),
        "packing": bool(data.packing),
        "val_fraction": float(data.val_fraction),
        "seed": int(cfg.run.seed),
        "global_batch": (
            int(data.batch_size) * int(cfg.trainer.accumulate_grad_batches) * int(world)
        ),
    }


def _write_json(path: Path, record: Any) -> None:
    from draftsmith.common.atomic_folder import write_file

    write_file(path, json.dumps(record, indent=1) + "\n")


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{path} ({what}) is corrupt ({err}); restore it, or start over in a new run folder"
        ) from None


def lineage_of(config: dict[str, Any]) -> dict[str, Any]:
    """An export's lineage record; an export written before lineages existed gets one from its
    ``training`` block (its data order unknown, so a warm start from it starts the data at its
    beginning)."""
    training = config.get("training") or {}
    if isinstance(training.get("lineage"), dict):
        return training["lineage"]
    steps, tokens = int(training.get("steps") or 0), int(training.get("tokens") or 0)
    return {
        "data_order": None,
        "order_steps": 0,
        "steps_total": steps,
        "tokens_total": tokens,
        "wall_seconds_total": training.get("fit_seconds"),
        "cpu_seconds_total": None,
        "runs": [{"steps": steps, "tokens": tokens, "note": "trained before lineage records"}],
    }


def lineage_from_run(run_dir: str | Path, config: dict[str, Any]) -> dict[str, Any]:
    """The lineage of an export whose run folder is at hand (``run_dir/.hydra/config.yaml``): an
    export written before lineages existed gets its data order from the run's config, so a warm
    start from it continues the order.
    """
    from omegaconf import OmegaConf

    lineage = lineage_of(config)
    saved = Path(run_dir) / ".hydra" / "config.yaml"
    if lineage["data_order"] is not None or not saved.is_file():
        return lineage
    cfg = OmegaConf.load(saved)
    overrides = Path(run_dir) / ".hydra" / "overrides.yaml"
    # the command, as the run's own record of its overrides gives it
    if overrides.is_file() and lineage["runs"]:
        words = [str(o) for o in OmegaConf.to_container(OmegaConf.load(overrides))]
        lineage["runs"][-1]["command"] = shlex.join(["train.py", *words])
    return {**lineage, "data_order": data_order(cfg), "order_steps": lineage["steps_total"]}


def _check_same_module(path: str, config: dict[str, Any], export_config: dict[str, Any]) -> None:
    if config["method"] != export_config["method"]:
        raise ConfigError(
            f"run.init_from={path} holds a {config['method']} export and this run trains "
            f"{export_config['method']}: warm-start from an export of the same method"
        )
    mine, theirs = dict(export_config["architecture"]), dict(config["architecture"])
    changed = [
        f"{k} {theirs.get(k, '(unset)')} -> {mine.get(k, '(unset)')}"
        for k in sorted(set(mine) | set(theirs))
        if mine.get(k) != theirs.get(k)
    ]
    if changed:
        raise ConfigError(
            f"run.init_from={path}: its architecture differs from this run's"
            f" ({'; '.join(changed[:3])}): set the same drafter options, or train from scratch"
        )


def load_init(path: str, objective: Any, target: Any) -> dict[str, Any]:
    """Load the drafter weights of export ``path`` into ``objective.module`` after checking method,
    architecture and target; returns the export's lineage (with its fingerprint as ``export``)."""
    from draftsmith.export.format import read_export
    from draftsmith.export.stacking import export_fingerprint
    from draftsmith.export.target_check import check_target

    config, state = read_export(
        path
    )  # a missing, damaged or partial export is one line (ExportError)
    _check_same_module(path, config, objective.export_config())
    if len(config.get("parts") or {}) > 1:
        raise ConfigError(
            f"run.init_from={path}: a warm start loads single-part exports; it has parts "
            f"{sorted(config['parts'])}"
        )
    check_target(
        config, target.identity(), given=None
    )  # TargetMismatchError: one line naming both targets
    module = objective.module
    own = module.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ConfigError(
            f"run.init_from={path}: its weights do not fit this drafter (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})
    return {**lineage_of(config), "export": export_fingerprint(path), "export_path": str(path)}


def prepare(
    cfg: Any,
    objective: Any,
    target: Any,
    data: Any,
    run_dir: str | Path,
    resuming: bool,
) -> dict[str, Any] | None:
    """Before training: on a fresh start with ``run.init_from``, load the export's weights and keep
    its lineage in ``run_dir/warm_start.json``; on a resume, read that file back (the weights come
    from the checkpoint). Either way set the data module's step offset when the data order is the
    export's. Returns the prior lineage, or None.
    """
    path = (cfg.run.get("init_from") or None) if "run" in cfg else None
    record = Path(run_dir) / WARM_FILE
    if resuming:
        prior = _read_json(record, "the warm start's record") if record.is_file() else None
        if path and prior is None:
            log.info("run.init_from=%s ignored: this run resumes from its own checkpoint", path)
    elif path:
        prior = load_init(str(path), objective, target)
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        _write_json(record, prior)
        log.info(
            "warm start from %s (%s tokens so far): fresh optimizer state and warm-up",
            path,
            f"{int(prior.get('tokens_total') or 0):,}",
        )
    else:
        return None
    if prior is None:
        return None
    offset = continued_steps(prior, data_order(cfg))
    if offset and hasattr(data, "step_offset"):
        data.step_offset = offset
        log.info(
            "data order continued: skipping the %d global batches the export trained on", offset
        )
    elif offset:
        log.warning(
            "this data module cannot skip batches (a feature cache?): the data order starts over"
        )
    return prior


def continued_steps(prior: dict[str, Any], order: dict[str, Any]) -> int:
    """Global batches of ``order`` the prior runs consumed (0 when they trained on another
    order)."""
    return int(prior.get("order_steps") or 0) if prior.get("data_order") == order else 0


def continue_data_order(loader: Any, step_offset: int, accumulate: int) -> int:
    """Make ``loader``'s next pass start where ``step_offset`` optimizer steps of this data order
    left it (the data module calls this for a fresh warm-started run; a resumed one gets the same
    position from its checkpoint). Returns the batches skipped."""
    skip = batches_done_in_epoch(int(step_offset), len(loader), int(accumulate))
    loader.sampler.skip_next(skip * int(getattr(loader, "_items_per_batch", 1)))
    return skip


def machine() -> str:
    """The hardware a sitting ran on: the CPU model and ISA, and the GPU when one trained."""
    import torch

    from draftsmith.kernels import cpu_caps

    gpu = f"; GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{cpu_caps.probe().describe()}, {os.cpu_count()} cores{gpu}"


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class SittingLog(pl.Callback):
    """Appends one sitting (this process's part of the run: steps, wall and CPU seconds, machine,
    date) to ``<run dir>/sittings.json`` when fit ends, normally or by an exception (Ctrl-C,
    SIGTERM's checkpoint-and-stop).
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / SITTINGS_FILE
        self.start: tuple[float, float, int] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after a resume's checkpoint is restored (at on_fit_start the global step still reads 0)
        self.start = (time.time(), _cpu_seconds(), int(trainer.global_step))

    def _append(self, trainer: pl.Trainer) -> None:
        if self.start is None or not trainer.is_global_zero:
            return
        began, cpu, step = self.start
        self.start = None
        kept = _read_json(self.path, "the run's sittings") if self.path.is_file() else []
        kept.append(
            {
                "machine": machine(),
                "began": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(began)),
                "wall_seconds": round(time.time() - began, 1),
                "cpu_seconds": round(_cpu_seconds() - cpu, 1),
                "steps": [step, int(trainer.global_step)],
            }
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _write_json(self.path, kept)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._append(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._append(trainer)


def lineage(
    cfg: Any,
    prior: dict[str, Any] | None,
    steps: int,
    tokens: int,
    run_dir: str | Path,
    world: int | None = None,
) -> dict[str, Any]:
    """The record this run's export carries: the prior lineage (None: trained from scratch) plus
    this run."""
    order = data_order(cfg, world)
    path = Path(run_dir) / SITTINGS_FILE
    sittings = _read_json(path, "the run's sittings") if path.is_file() else []
    wall, cpu = sum(s["wall_seconds"] for s in sittings), sum(s["cpu_seconds"] for s in sittings)
    run = {
        "steps": steps,
        "tokens": tokens,
        "wall_seconds": round(wall, 1),
        "cpu_seconds": round(cpu, 1),
        "machines": sorted({s["machine"] for s in sittings}),
        "sittings": len(sittings),
        "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "started_from": (prior or {}).get("export"),
        "data_order_continued": None if prior is None else continued_steps(prior, order) > 0,
    }
    before = prior or {"order_steps": 0, "steps_total": 0, "tokens_total": 0, "runs": []}
    same = prior is not None and prior.get("data_order") == order
    return {
        "data_order": order,
        "order_steps": (int(before.get("order_steps") or 0) if same else 0) + steps,
        "steps_total": int(before.get("steps_total") or 0) + steps,
        "tokens_total": int(before.get("tokens_total") or 0) + tokens,
        "wall_seconds_total": round((before.get("wall_seconds_total") or 0.0) + wall, 1),
        "cpu_seconds_total": round((before.get("cpu_seconds_total") or 0.0) + cpu, 1),
        "runs": [*before.get("runs", []), run],
    }
