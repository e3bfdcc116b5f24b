"""The trajectory folder format (``draftsmith trajectories`` writes it, ``recipe=learn2pd`` reads
it): its file names and its reader. ``meta.json`` holds the settings, ``shard-NNNNN.safetensors``
the oracle examples (``conf`` [n, L] block confidences and ``labels`` [n, L] "already final").
Training imports this reader without pulling in the decoding code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from draftsmith.common.errors import DraftsmithError

META = "meta.json"
SHARD = "shard-{:05d}.safetensors"
SHARD_GLOB = "shard-*.safetensors"


class TrajectoryFolderError(DraftsmithError, ValueError):
    """A trajectory folder that is missing, empty, incomplete or corrupt; the message says the
    fix."""


def read_trajectories(folder: str | Path) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """``(meta, conf [N, L], labels [N, L])`` of a trajectory folder, with one clear error for each
    broken state."""
    from safetensors import safe_open

    folder = Path(folder)
    fix = f"run `draftsmith trajectories --target ... --prompts ... --out {folder}` (it resumes)"
    if not folder.is_dir():
        raise TrajectoryFolderError(f"trajectory folder {folder} does not exist; {fix}")
    if not (folder / META).is_file():
        raise TrajectoryFolderError(
            f"{folder} has no {META}: it is empty or not a trajectory folder; {fix}"
        )
    meta = json.loads((folder / META).read_text())
    shards = sorted(folder.glob(SHARD_GLOB))
    expected = -(-int(meta["num_prompts"]) // int(meta["shard_size"]))
    if not shards:
        raise TrajectoryFolderError(
            f"{folder} holds no trajectory shards (expected {expected}); {fix}"
        )
    if len(shards) < expected:
        raise TrajectoryFolderError(
            f"{folder} is incomplete: {len(shards)} of {expected} shards; {fix} to finish it"
        )
    confs, labels = [], []
    for path in shards:
        try:
            with safe_open(str(path), framework="pt") as handle:
                confs.append(handle.get_tensor("conf").float())  # [n, L]
                labels.append(handle.get_tensor("labels").float())  # [n, L]
        # safetensors raises several types for truncated files
        except Exception as err:  # noqa: BLE001
            raise TrajectoryFolderError(
                f"trajectory shard {path} is truncated or corrupt ({type(err).__name__}); "
                f"delete it and {fix} to rewrite it"
            ) from None
    conf, label = torch.cat(confs), torch.cat(labels)
    if conf.shape[1] != int(meta["block_length"]) or conf.shape != label.shape or not len(conf):
        raise TrajectoryFolderError(
            f"{folder}: shards do not match block length {meta['block_length']} "
            f"(conf {tuple(conf.shape)}, labels {tuple(label.shape)}); regenerate the folder"
        )
    return meta, conf, label
