"""Training entry point: ``python train.py recipe=medusa [hydra overrides]`` (``--help``: the
recipes; ``recipe=NAME --help``: that recipe's keys, from its schema in
recipes/<name>/__init__.py). The command line is checked and ``--help`` written before Hydra runs by
cli/train_command_line.py; this file runs the Hydra app and reports how a run ended."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

# registers every recipe: its schema is what conf/train.yaml names
import draftsmith.recipes  # noqa: F401
from draftsmith.cli.train_command_line import (
    CONF_DIR,
    check_launcher,
    expand_shorthands,
    help_text,
    preflight,
)

log = logging.getLogger("draftsmith.train")


def slug(text: str) -> str:
    """Folder-safe form of Hydra's override string (paths in overrides must not nest folders)."""
    cleaned = "".join(c if c.isalnum() or c in "=,._-" else "_" for c in str(text)).strip("_")
    return cleaned[:180] or "default"


# Registered at import so `hydra.run.dir` can use it before the job starts.
OmegaConf.register_new_resolver("slug", slug, replace=True)


def purposeful_errors() -> tuple[type[BaseException], ...]:
    """Errors draftsmith raises on purpose with a message for the user (bad config, bad data,
    diverged run)."""
    from draftsmith.assets import AssetError
    from draftsmith.common.errors import DraftsmithError
    from draftsmith.export.format import ExportError

    return DraftsmithError, ExportError, AssetError


PREEMPTED_EXIT = 143  # 128 + SIGTERM, what a shell reports for a job ended by SIGTERM
INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for a job ended by Ctrl-C


def resume_command(argv: list[str]) -> str:
    """The command line that resumes this run: the same one (``run.resume=auto`` finds the run
    folder's newest checkpoint), without a ``run.resume=false`` that would start over."""
    import shlex

    prog, *args = argv or ["train.py"]
    args = [a for a in args if a.split("=", 1)[0].lstrip("+") != "run.resume"]
    head = prog if not prog.endswith(".py") else f"python {shlex.quote(prog)}"
    return " ".join([head, *(shlex.quote(a) for a in args)])


def interrupted_message(err: BaseException, argv: list[str], run_dir: str) -> str:
    """What Ctrl-C prints: the step, where the newest checkpoint is (or that none was written yet)
    and the command that resumes."""
    step = getattr(err, "step", None)
    checkpoint = getattr(err, "checkpoint", None)
    every = getattr(err, "checkpoint_every", None)
    if checkpoint is None:
        from draftsmith.distill.engine.resume_point import find_resume_checkpoint

        found = find_resume_checkpoint(getattr(err, "run_dir", run_dir))
        checkpoint = str(found) if found else None
    at = f" at step {step}" if step is not None else ""
    if checkpoint:
        return (
            f"interrupted (Ctrl-C){at}; the last checkpoint is {checkpoint}; resume with: "
            f"{resume_command(argv)}"
        )
    first = f" (the first comes after run.checkpoint_every={every} steps)" if every else ""
    return (
        f"interrupted (Ctrl-C){at}; no checkpoint was written yet{first}, so nothing to resume;"
        f" start again with: {resume_command(argv)}"
    )


def preempted() -> tuple[type[BaseException], ...]:
    """Lightning's ``SIGTERMException``: training stopped on SIGTERM after saving a checkpoint."""
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    return (SIGTERMException,)


def report_error(err: BaseException | str) -> None:
    """Print ``error: <message>`` as one line on stderr (and into the run log)."""
    message = " ".join(str(err).split()) or type(err).__name__
    log.error("%s: %s", "stopped" if isinstance(err, str) else type(err).__name__, message)
    print(f"error: {message}", file=sys.stderr, flush=True)


def served_probe(cfg: DictConfig) -> Any:
    """The served-tau probe ``validation.served_tau`` asks for (``draftsmith.evals.served_tau``), or
    None when off. Built here because training (``distill/``) never imports serving code; bad values
    are a ConfigError.
    """
    from draftsmith.common.errors import ConfigError

    block = (cfg.get("validation") or {}).get("served_tau")
    if not block or not block.get("every"):
        return None  # off: the serving code is not even imported (docs/ARCHITECTURE.md, the walks)
    from draftsmith.evals.served_tau import probe_from_config

    try:
        return probe_from_config(cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None


# An absolute config path: Hydra resolves a relative one against the calling module, which breaks
# when this file runs as `draftsmith.train` (the `draftsmith train` command) instead of as a script.
@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Compose the config, pick the registered recipe, train, export; returns the final val loss for
    sweeps.

    A purposeful error ends the run with one ``error: ...`` line on stderr and exit status 1;
    Hydra's partial traceback is only for bugs (and for every error under ``HYDRA_FULL_ERROR=1``).
    """
    from draftsmith import recipes
    from draftsmith.common.errors import report_failure, traceback_requested
    from draftsmith.distill.engine.trainer import train

    recipe = recipes.get_recipe(cfg.recipe.name)
    hydra_cfg = HydraConfig.get()
    run_name = f"{cfg.recipe.name}-{slug(hydra_cfg.job.override_dirname)}"
    # offline: batches and target features from a cache, the target never loaded
    if cfg.data.features:
        from draftsmith.distill.feature_cache.cached_data import train_offline as train
    try:
        # offline runs never load the target; the probe would (off there, for now)
        if cfg.data.features:
            summary = train(cfg, recipe, hydra_cfg.runtime.output_dir, run_name=run_name)
        else:
            summary = train(
                cfg,
                recipe,
                hydra_cfg.runtime.output_dir,
                run_name=run_name,
                served_probe=served_probe(cfg),
            )
    # Ctrl-C: where the checkpoint is and how to resume, exit 130 like a shell
    except KeyboardInterrupt as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or traceback_requested():
            raise
        report_error(interrupted_message(err, sys.argv, hydra_cfg.runtime.output_dir))
        sys.exit(INTERRUPTED_EXIT)
    except preempted() as err:
        # SIGTERM (SLURM preemption): ClusterCallback saved a checkpoint; the requeued attempt
        # resumes from it.
        report_error(
            f"preempted by SIGTERM ({type(err).__name__}): checkpoint saved in"
            f" {hydra_cfg.runtime.output_dir}/checkpoints; run the same command again (SLURM"
            " requeues it) to resume"
        )
        sys.exit(PREEMPTED_EXIT)
    except purposeful_errors() as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or traceback_requested():
            raise
        report_error(err)
        # SystemExit passes through Hydra's handler, which would print a traceback for an Exception
        sys.exit(1)
    # a bug: its traceback and a line saying so (common/errors.py's policy
    except Exception as err:  # noqa: BLE001
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        sys.exit(report_failure(err, ""))
    print(json.dumps(summary, indent=2))
    return summary["metrics"].get("val/loss")


def run_command_line(argv: list[str], prog: str) -> None:
    """``python train.py ARGS`` / ``draftsmith train ARGS``: ``--help`` prints the usage (or, with
    ``recipe=NAME``, that recipe's keys); a config that does not compose or check is one ``error:``
    line and exit 1, before Hydra makes a run folder; otherwise Hydra runs :func:`main`."""
    argv = expand_shorthands(argv)
    if "--help" in argv or "-h" in argv:
        print(help_text(argv, prog))
        sys.exit(0)
    from draftsmith.common.atomic_folder import (
        run_folder_problem,
    )  # hydra.run.dir: a folder a run may write

    if (problem := check_launcher(argv) or preflight(argv) or run_folder_problem(argv)) is not None:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        sys.exit(1)
    sys.argv = [prog, *argv]
    main()


if __name__ == "__main__":
    run_command_line(sys.argv[1:], sys.argv[0])
