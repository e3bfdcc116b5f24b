"""Training entry point: ``python train.py recipe=medusa [hydra overrides]``."""

from __future__ import annotations

import json
import logging

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


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Compose the config, pick the registered recipe, train, export; returns the final val loss for sweeps."""
    from draftsmith import recipes
    from draftsmith.distill.trainer import train

    recipe = recipes.get_recipe(cfg.recipe.name)
    summary = train(cfg, recipe, HydraConfig.get().runtime.output_dir)
    print(json.dumps(summary, indent=2))
    return summary["metrics"].get("val/loss")


if __name__ == "__main__":
    main()
