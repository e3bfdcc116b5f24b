"""Training entry point: ``python train.py recipe=medusa [hydra overrides]`` (``--help``: the
recipes; ``recipe=NAME --help``: that recipe's keys, from its schema in
recipes/<name>/__init__.py)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import draftsmith.recipes  # noqa: F401  (registers every recipe: its schema is what conf/train.yaml names)

log = logging.getLogger("draftsmith.train")


def slug(text: str) -> str:
    """Folder-safe form of Hydra's override string (paths in overrides must not nest folders)."""
    cleaned = "".join(c if c.isalnum() or c in "=,._-" else "_" for c in str(text)).strip("_")
    return cleaned[:180] or "default"


# Registered at import so `hydra.run.dir` can use it before the job starts.
OmegaConf.register_new_resolver("slug", slug, replace=True)


CONF_DIR = Path(__file__).resolve().parent / "conf"
# `target=PATH` / `data=PATH` shorthands: a value that is not an option of the group is a model
# folder / data spec.
SHORTHANDS = {"target": "target.name_or_path", "data": "data.spec"}


def expand_shorthands(argv: list[str]) -> list[str]:
    """Rewrite ``target=/models/x`` to ``target.name_or_path=/models/x`` and ``data=chats.jsonl`` to
    ``data.spec=chats.jsonl`` unless the value names a config of that group (``target=smollm2``
    stays a group choice).
    """
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in SHORTHANDS and value and not (CONF_DIR / key / f"{value}.yaml").is_file():
            arg = f"{SHORTHANDS[key]}={value}"
        out.append(arg)
    return out


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
    if (
        cfg.data.features
    ):  # offline: batches and target features from a cache, the target never loaded
        from draftsmith.distill.feature_cache.cached_data import train_offline as train
    try:
        if (
            cfg.data.features
        ):  # offline runs never load the target; the probe would (off there, for now)
            summary = train(cfg, recipe, hydra_cfg.runtime.output_dir, run_name=run_name)
        else:
            summary = train(
                cfg,
                recipe,
                hydra_cfg.runtime.output_dir,
                run_name=run_name,
                served_probe=served_probe(cfg),
            )
    except (
        KeyboardInterrupt
    ) as err:  # Ctrl-C: where the checkpoint is and how to resume, exit 130 like a shell
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
    except Exception as err:  # noqa: BLE001 - a bug: its traceback and a line saying so (common/errors.py's policy)
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        sys.exit(report_failure(err, ""))
    print(json.dumps(summary, indent=2))
    return summary["metrics"].get("val/loss")


def check_launcher(argv: list[str]) -> str | None:
    """The error to print when ``hydra/launcher=slurm`` is asked for without hydra-submitit-launcher
    installed (Hydra's own message would be a missing config deep in a traceback), else None."""
    import importlib.util

    wants = any(
        a.split("=", 1)[0] in ("hydra/launcher", "+hydra/launcher")
        and "=" in a
        and a.split("=", 1)[1].startswith(("slurm", "submitit"))
        for a in argv
    )
    if wants and importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        return (
            "hydra/launcher=slurm needs the submitit launcher: pip install hydra-submitit-launcher "
            "(or `pip install draftsmith[slurm]`), then submit again"
        )
    return None


def recipe_names() -> list[str]:
    """Every registered recipe (draftsmith.recipes); a YAML file under conf/recipe/ alone is not
    one."""
    from draftsmith.recipes import recipe_names as registered

    return registered()


def chosen_recipe(overrides: list[str]) -> str | None:
    """The value of ``recipe=NAME`` on the command line, or None."""
    return next(
        (a.split("=", 1)[1] for a in overrides if a.split("=", 1)[0].lstrip("+") == "recipe"), None
    )


def plain_overrides(argv: list[str]) -> list[str] | None:
    """The overrides of a run or a sweep (``--cfg job``, ``--resolve``, ``-m`` dropped); None for
    another Hydra flag, which Hydra handles itself."""
    out, skip = [], False
    for arg in argv:
        if skip or arg in ("--resolve", "-m", "--multirun"):
            skip = False
            continue
        if arg in ("--cfg", "-c"):
            skip = True
        elif arg.startswith("-"):
            return None
        else:
            out.append(arg)
    return out


def sweep_jobs(overrides: list[str]) -> list[list[str]] | None:
    """The override lists that check a sweep: every value of ``key=a,b`` once, the other keys at
    their first value (one list for a single run); None for a sweep Hydra expands itself
    (``range(...)``, quotes)."""
    keys, choices = [], []
    for arg in overrides:
        key, sep, value = arg.partition("=")
        whole = value[:1] in ("[", "{") and value[-1:] in (
            "]",
            "}",
        )  # a list or dict value, not a sweep
        if "," in value and not whole and any(c in value for c in "()[]{}'\""):
            return None
        keys.append(f"{key}{sep}")
        choices.append([value] if whole or not sep else value.split(","))
    first = [k + c[0] for k, c in zip(keys, choices)]
    return [first] + [
        first[:i] + [keys[i] + v] + first[i + 1 :] for i, c in enumerate(choices) for v in c[1:]
    ]


def compose_overrides(overrides: list[str]) -> DictConfig:
    """Compose conf/train.yaml with ``overrides`` outside a Hydra app (the schemas are stored at
    import)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=overrides)


def composition_message(err: BaseException, overrides: list[str]) -> str:
    """One line for a config that does not compose: no or an unknown recipe, a key the recipe's
    schema lacks (with the close match), a value of the wrong type; Hydra's own message flattened
    otherwise."""
    import re

    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    from draftsmith.distill.config.checks import unknown_key_message
    from draftsmith.recipes import RECIPES

    recipe, text, cause = chosen_recipe(overrides), str(err), err.__cause__
    if "You must specify 'recipe'" in text:
        return (
            f"no recipe: pick one with recipe=NAME ({', '.join(recipe_names())}); python train.py"
            " --help says more"
        )
    missing = re.search(r"Could not find '(recipe|schema)/([^']*)'", text)
    if missing and missing.group(2) not in RECIPES:
        return f"unknown recipe {missing.group(2)!r}; valid recipes: {', '.join(recipe_names())}"
    if missing:  # registered, but conf/recipe/<name>.yaml is gone
        return (
            f"recipe {missing.group(2)!r} has no config: conf/recipe/{missing.group(2)}.yaml is"
            " missing"
        )
    full_key = getattr(cause, "full_key", None)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and full_key and recipe in RECIPES:
        return unknown_key_message(str(full_key), recipe, RECIPES[recipe].schema)
    if isinstance(cause, ValidationError) and full_key:
        given = next(
            (a.split("=", 1)[1] for a in overrides if a.split("=", 1)[0].lstrip("+") == full_key),
            "",
        )
        return f"{full_key}={given}: {str(cause).splitlines()[0]}"
    detail = f" ({str(cause).splitlines()[0]})" if cause is not None and str(cause) else ""
    return " ".join(text.split()) + detail


def preflight(argv: list[str]) -> str | None:
    """The one-line error for a command line whose config does not compose, names a key its recipe's
    schema lacks or a value outside its declared range (for a sweep, in any of its jobs); None when
    it is fine.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from draftsmith.distill.config.checks import (
        repeated_override,
        schema_problems,
        target_folder_problem,
    )

    overrides = plain_overrides(argv)
    if overrides is not None and (repeated := repeated_override(overrides)) is not None:
        return repeated
    jobs = sweep_jobs(overrides) if overrides is not None else None
    for job in jobs or []:
        try:
            cfg = compose_overrides(job)
        except (HydraException, OmegaConfBaseException) as err:
            return composition_message(err, job)
        if problems := schema_problems(cfg):
            return "; ".join(problems)
        if (problem := target_folder_problem(str(cfg.target.name_or_path))) is not None:
            return problem
    return None


def help_text(argv: list[str], prog: str) -> str:
    """``--help``: the usage and the recipes; with ``recipe=NAME``, that recipe's keys (type,
    default, doc, range)."""
    from draftsmith.distill.config.checks import describe_keys

    head = prog if not prog.endswith(".py") else f"python {Path(prog).name}"
    overrides = [a for a in plain_overrides([a for a in argv if a not in ("--help", "-h")]) or []]
    recipe = chosen_recipe(overrides)
    if recipe is not None:
        if (problem := preflight(overrides)) is not None:
            return f"error: {problem}"
        lines = describe_keys(compose_overrides(overrides))
        return "\n".join(
            [
                (
                    f"{head} recipe={recipe}: keys (set any with key=value; values shown with these"
                    " overrides applied)"
                ),
                *lines,
            ]
        )
    presets = {
        g: ", ".join(sorted(p.stem for p in (CONF_DIR / g).glob("*.yaml")))
        for g in ("trainer", "logger")
    }
    return "\n".join(
        [
            f"usage: {head} recipe=NAME [key=value ...]",
            "",
            (
                "Trains a drafter (or controller) against a frozen target and exports it into the"
                " run folder"
            ),
            (
                "(outputs/<recipe>/<overrides>; re-running the same command there resumes from its"
                " last checkpoint)."
            ),
            "",
            f"recipes: {', '.join(recipe_names())}",
            "",
            (
                f"  {head} recipe=NAME --help   list NAME's keys: type, default, meaning and"
                " allowed range"
            ),
            (
                "  target=PATH  data=PATH     the target model folder and the chat data"
                " (target.name_or_path, data.spec)"
            ),
            f"  trainer=PRESET             {presets['trainer']}",
            f"  logger=KIND                {presets['logger']}",
            (
                "  hydra.run.dir=DIR          the run folder; run.resume=false starts over in an"
                " existing one"
            ),
            (
                "  --cfg job                  print the composed config and exit; -m KEY=a,b runs a"
                " sweep"
            ),
        ]
    )


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
