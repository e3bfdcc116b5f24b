"""Training entry point: ``python train.py recipe=medusa [hydra overrides]``."""

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

log = logging.getLogger("draftsmith.train")


def slug(text: str) -> str:
    """Folder-safe form of Hydra's override string (paths in overrides must not nest folders)."""
    cleaned = "".join(c if c.isalnum() or c in "=,._-" else "_" for c in str(text)).strip("_")
    return cleaned[:180] or "default"


# Registered at import so `hydra.run.dir` can use it before the job starts.
OmegaConf.register_new_resolver("slug", slug, replace=True)


CONF_DIR = Path(__file__).resolve().parent / "conf"
# `target=PATH` / `data=PATH` shorthands: a value that is not an option of the group is a model folder / data spec.
SHORTHANDS = {"target": "target.name_or_path", "data": "data.spec"}


def expand_shorthands(argv: list[str]) -> list[str]:
    """Rewrite ``target=/models/x`` to ``target.name_or_path=/models/x`` and ``data=chats.jsonl`` to
    ``data.spec=chats.jsonl`` unless the value names a config of that group (``target=smollm2`` stays a group choice).
    """
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in SHORTHANDS and value and not (CONF_DIR / key / f"{value}.yaml").is_file():
            arg = f"{SHORTHANDS[key]}={value}"
        out.append(arg)
    return out


def purposeful_errors() -> tuple[type[BaseException], ...]:
    """Errors draftsmith raises on purpose with a message for the user (bad config, bad data, diverged run)."""
    from draftsmith.assets import AssetError
    from draftsmith.distill.errors import DraftsmithError
    from draftsmith.export.format import ExportError

    return DraftsmithError, ExportError, AssetError


PREEMPTED_EXIT = 143  # 128 + SIGTERM, what a shell reports for a job ended by SIGTERM
INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for a job ended by Ctrl-C
# Keys the code reads with a default although no config file sets them (`+key=value` may add these).
OPTIONAL_KEYS = frozenset({"drafter.noise_std", "drafter.noise_ref_len"})


def flat_keys(node, prefix: str = "") -> list[str]:
    """Every dotted key of a config (inner nodes too), e.g. ``heads``, ``heads.num_heads``."""
    out = []
    if isinstance(node, DictConfig):
        for key in node.keys():
            path = f"{prefix}{key}"
            out.append(path)
            child = node._get_node(key)
            if isinstance(child, DictConfig):
                out.extend(flat_keys(child, f"{path}."))
    return out


def unknown_added_keys(cfg: DictConfig, overrides: list[str]) -> str | None:
    """The error for ``+key=value`` overrides that add a key no config of this recipe has (a typo such as
    ``+heads.num_head=4`` would otherwise train with the default silently), with close matches; else None.
    Hydra accepts ``+key`` only for a key its config lacks, so every such key is new; group additions
    (``+hydra/launcher=x``), ``hydra.*`` keys and :data:`OPTIONAL_KEYS` pass."""
    import difflib

    added = []
    for override in overrides:
        if not override.startswith("+") or override.startswith("++"):
            continue
        key, _, value = override[1:].partition("=")
        key = key.strip()
        if "/" in key or key.startswith("hydra.") or key in OPTIONAL_KEYS or (CONF_DIR / key).is_dir():
            continue
        added.append((key, value))
    if not added:
        return None
    new = {key for key, _ in added}
    known = [k for k in flat_keys(cfg) if k not in new and not any(k.startswith(f"{n}.") for n in new)]
    problems = []
    for key, value in added:
        close = difflib.get_close_matches(key, known, n=3, cutoff=0.75)
        if not close:  # the same leaf under another parent (heads.draft_vocab_size vs drafter.draft_vocab_size)
            leaf = leaf_of(key)
            close = [k for k in known if difflib.SequenceMatcher(None, leaf, leaf_of(k)).ratio() >= 0.85][:3]
        hint = (f"; did you mean {' or '.join(close)}? (set an existing key without '+', e.g. {close[0]}={value})"
                if close else "; drop it, or see conf/ for the keys this recipe reads")
        problems.append(f"+{key}={value} adds a key that no config of recipe={cfg.recipe.name} reads{hint}")
    return " | ".join(problems)


def leaf_of(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def resume_command(argv: list[str]) -> str:
    """The command line that resumes this run: the same one (``run.resume=auto`` finds the run folder's newest
    checkpoint), without a ``run.resume=false`` that would start over."""
    import shlex

    prog, *args = argv or ["train.py"]
    args = [a for a in args if a.split("=", 1)[0].lstrip("+") != "run.resume"]
    head = prog if not prog.endswith(".py") else f"python {shlex.quote(prog)}"
    return " ".join([head, *(shlex.quote(a) for a in args)])


def interrupted_message(err: BaseException, argv: list[str], run_dir: str) -> str:
    """What Ctrl-C prints: the step, where the newest checkpoint is (or that none was written yet) and the command
    that resumes."""
    step = getattr(err, "step", None)
    checkpoint = getattr(err, "checkpoint", None)
    every = getattr(err, "checkpoint_every", None)
    if checkpoint is None:
        from draftsmith.distill.checkpoints import find_resume_checkpoint

        found = find_resume_checkpoint(getattr(err, "run_dir", run_dir))
        checkpoint = str(found) if found else None
    at = f" at step {step}" if step is not None else ""
    if checkpoint:
        return (f"interrupted (Ctrl-C){at}; the last checkpoint is {checkpoint}; resume with: "
                f"{resume_command(argv)}")
    first = f" (the first comes after run.checkpoint_every={every} steps)" if every else ""
    return (f"interrupted (Ctrl-C){at}; no checkpoint was written yet{first}, so nothing to resume; start again "
            f"with: {resume_command(argv)}")


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
    """The served-tau probe ``validation.served_tau`` asks for (``draftsmith.evals.served_tau``), or None when off.
    Built here because training (``distill/``) never imports serving code; bad values are a ConfigError."""
    from draftsmith.distill.errors import ConfigError

    block = (cfg.get("validation") or {}).get("served_tau")
    if not block or not block.get("every"):
        return None  # off: the serving code is not even imported (docs/ARCHITECTURE.md, the walks)
    from draftsmith.evals.served_tau import probe_from_config

    try:
        return probe_from_config(cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None


# An absolute config path: Hydra resolves a relative one against the calling module, which breaks when this file
# runs as `draftsmith.train` (the `draftsmith train` command) instead of as a script.
@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Compose the config, pick the registered recipe, train, export; returns the final val loss for sweeps.

    A purposeful error ends the run with one ``error: ...`` line on stderr and exit status 1; Hydra's partial
    traceback is only for bugs (and for every error under ``HYDRA_FULL_ERROR=1``).
    """
    from draftsmith import recipes
    from draftsmith.distill.trainer import train

    recipe = recipes.get_recipe(cfg.recipe.name)
    hydra_cfg = HydraConfig.get()
    run_name = f"{cfg.recipe.name}-{slug(hydra_cfg.job.override_dirname)}"
    if cfg.data.get("features"):  # offline: batches and target features from a cache, the target never loaded
        from draftsmith.distill.cached_features import train_offline as train
    try:
        from draftsmith.distill.errors import ConfigError

        if (problem := unknown_added_keys(cfg, list(hydra_cfg.overrides.task))) is not None:
            raise ConfigError(problem)
        if cfg.data.get("features"):  # offline runs never load the target; the probe would (off there, for now)
            summary = train(cfg, recipe, hydra_cfg.runtime.output_dir, run_name=run_name)
        else:
            summary = train(cfg, recipe, hydra_cfg.runtime.output_dir, run_name=run_name,
                            served_probe=served_probe(cfg))
    except KeyboardInterrupt as err:  # Ctrl-C: where the checkpoint is and how to resume, exit 130 like a shell
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or os.environ.get("DRAFTSMITH_DEBUG") == "1":
            raise
        report_error(interrupted_message(err, sys.argv, hydra_cfg.runtime.output_dir))
        sys.exit(INTERRUPTED_EXIT)
    except preempted() as err:
        # SIGTERM (SLURM preemption): ClusterCallback saved a checkpoint; the requeued attempt resumes from it.
        report_error(f"preempted by SIGTERM ({type(err).__name__}): checkpoint saved in {hydra_cfg.runtime.output_dir}"
                     "/checkpoints; run the same command again (SLURM requeues it) to resume")
        sys.exit(PREEMPTED_EXIT)
    except purposeful_errors() as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or os.environ.get("DRAFTSMITH_DEBUG") == "1":
            raise
        report_error(err)
        sys.exit(1)  # SystemExit passes through Hydra's handler, which would print a traceback for an Exception
    print(json.dumps(summary, indent=2))
    return summary["metrics"].get("val/loss")


def check_launcher(argv: list[str]) -> str | None:
    """The error to print when ``hydra/launcher=slurm`` is asked for without hydra-submitit-launcher installed (Hydra's
    own message would be a missing config deep in a traceback), else None."""
    import importlib.util

    wants = any(a.split("=", 1)[0] in ("hydra/launcher", "+hydra/launcher") and "=" in a and
                a.split("=", 1)[1].startswith(("slurm", "submitit")) for a in argv)
    if wants and importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        return ("hydra/launcher=slurm needs the submitit launcher: pip install hydra-submitit-launcher "
                "(or `pip install draftsmith[slurm]`), then submit again")
    return None


if __name__ == "__main__":
    sys.argv = [sys.argv[0], *expand_shorthands(sys.argv[1:])]
    if (problem := check_launcher(sys.argv[1:])) is not None:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        sys.exit(1)
    main()
