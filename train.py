"""Training entry point: ``python train.py recipe=medusa [hydra overrides]``."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

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


def report_error(err: BaseException) -> None:
    """Print ``error: <message>`` as one line on stderr (and into the run log)."""
    message = " ".join(str(err).split()) or type(err).__name__
    log.error("%s: %s", type(err).__name__, message)
    print(f"error: {message}", file=sys.stderr, flush=True)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Compose the config, pick the registered recipe, train, export; returns the final val loss for sweeps.

    A purposeful error ends the run with one ``error: ...`` line on stderr and exit status 1; Hydra's partial
    traceback is only for bugs (and for every error under ``HYDRA_FULL_ERROR=1``).
    """
    from draftsmith import recipes
    from draftsmith.distill.trainer import train

    recipe = recipes.get_recipe(cfg.recipe.name)
    try:
        summary = train(cfg, recipe, HydraConfig.get().runtime.output_dir)
    except purposeful_errors() as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        report_error(err)
        sys.exit(1)  # SystemExit passes through Hydra's handler, which would print a traceback for an Exception
    print(json.dumps(summary, indent=2))
    return summary["metrics"].get("val/loss")


if __name__ == "__main__":
    sys.argv = [sys.argv[0], *expand_shorthands(sys.argv[1:])]
    main()
