"""The run's CSV log, ``<run dir>/logs/metrics.csv``, kept across every attempt of a run.

Lightning's ``CSVLogger`` deletes ``metrics.csv`` when a logger opens a folder that holds one, so
each resume (after Ctrl-C, SIGTERM, kill -9, or a raised ``trainer.max_steps``) used to drop the
rows of the earlier attempts. :class:`RunCSVLogger` appends instead: the rows of every attempt stay,
in the order they were logged (steps that an attempt trained after its last checkpoint and the next
attempt trains again appear once per attempt). Rows are written at every logging step, so a killed
attempt keeps what it logged; a header that gains a column (the first ``val/`` metric) is rewritten
beside the file and swapped in, never truncated in place.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path

from lightning_fabric.loggers.logger import rank_zero_experiment
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter

log = logging.getLogger(__name__)


class AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer that keeps an existing ``metrics.csv`` (its rows and its columns) and
    appends."""

    def _check_log_dir_exists(
        self,
    ) -> None:  # Lightning's version deletes metrics.csv; read its header instead
        path = Path(self.metrics_file_path)
        if not path.is_file() or path.stat().st_size == 0:
            return
        try:
            with path.open(newline="", encoding="utf-8") as handle:
                header = next(csv.reader(handle), [])
                rows = sum(1 for _ in handle)
            if "\0" in "".join(header) or "step" not in header:
                raise ValueError("no step column")
        except (
            UnicodeDecodeError,
            csv.Error,
            ValueError,
        ) as err:  # not a CSV log: kept aside, never appended to
            aside = path.with_name(f"{path.name}.unreadable-{int(path.stat().st_mtime)}")
            os.replace(path, aside)
            log.warning(
                "%s is not a CSV log (%s): kept as %s; this attempt starts a new one",
                path,
                err,
                aside.name,
            )
            return
        with path.open(
            "rb+"
        ) as handle:  # a row a killed attempt left without its newline ends here
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                handle.write(b"\n")
        self.metrics_keys = sorted(set(header))
        log.info("appending to %s (%d rows of earlier attempts kept)", path, rows)

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        """Rewrite the file with more columns beside it, then rename it over the old one (a kill
        keeps either)."""
        path = Path(self.metrics_file_path)
        with path.open(newline="") as handle:
            rows = list(csv.DictReader(handle))
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with tmp.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=fieldnames)
            writer.writeheader()
            writer.writerows(rows)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)


class RunCSVLogger(CSVLogger):
    """``CSVLogger(save_dir=run_dir, name="logs", version="")`` that appends across attempts and
    writes its rows at every logging step (not every 100), so a killed attempt loses none."""

    def __init__(self, run_dir: str | Path) -> None:
        super().__init__(save_dir=str(run_dir), name="logs", version="", flush_logs_every_n_steps=1)

    @property
    @rank_zero_experiment
    def experiment(self) -> AppendingWriter:  # type: ignore[override]
        """The writer, created on first use (rank 0 only, as Lightning's)."""
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = AppendingWriter(log_dir=self.log_dir)
        return self._experiment


def build_loggers(cfg: DictConfig, run_dir: Path, run_name: str | None = None) -> list:
    """CSV always; wandb (offline unless logger.mode=online) when selected, named ``run_name``
    (recipe + overrides) and given the resolved config."""
    loggers: list = [
        RunCSVLogger(run_dir)
    ]  # appends across resumes (Lightning's CSVLogger deletes earlier rows)
    kind = cfg.logger.kind
    if kind == "wandb":
        from pytorch_lightning.loggers import WandbLogger

        mode = str(cfg.logger.mode or "offline")
        os.environ.setdefault("WANDB_MODE", mode)
        name = cfg.logger.name or run_name or str(cfg.recipe.name)
        loggers.append(
            WandbLogger(
                project=cfg.logger.project,
                entity=cfg.logger.entity,
                name=name,
                save_dir=str(run_dir),
                offline=mode == "offline",
                mode=mode,
                group=cfg.logger.group or str(cfg.recipe.name),
                config=OmegaConf.to_container(cfg, resolve=True),
            )
        )
    return loggers


def finish_loggers(loggers: list, export_dir: Path | None) -> None:
    """Attach the export's ``config.json`` to a wandb run (its files; synced later when offline) and
    finish the run, so that the next job of a sweep in this process starts its own run."""
    config = export_dir / "config.json" if export_dir is not None else None
    for logger in loggers:
        if type(logger).__name__ != "WandbLogger":
            continue
        if config is not None and config.is_file():
            logger.experiment.save(str(config), base_path=str(export_dir.parent), policy="now")
            logger.experiment.summary["export_config"] = json.loads(config.read_text())
        logger.experiment.finish()
