"""The rollout folder format (``draftsmith rollouts`` writes it, ``recipe=adaptive_temperature``
reads it): its file names and its reader. ``meta.json`` holds the settings (written first),
``rollouts.jsonl`` one line per prompt with its samples, their rewards and the chosen/rejected pair.
Plain stdlib: training imports this reader without pulling in the sampling code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith.common.errors import DraftsmithError

META, ROWS = "meta.json", "rollouts.jsonl"


class RolloutFolderError(DraftsmithError, ValueError):
    """A rollout folder that is missing, not a rollout folder, torn or without a pair; the message
    says the fix."""


def read_pairs(folder: str | Path) -> tuple[dict[str, Any], list[dict]]:
    """``(meta, pairs)`` of a rollout folder, each pair ``{prompt_ids, chosen: {tokens, temps},
    rejected, kind}``; RolloutFolderError with the fix for a missing folder, a folder that is not a
    rollout folder, or one without any pair."""
    folder = Path(folder)
    fix = f"run `draftsmith rollouts --out {folder} ...` first (it resumes)"
    if not folder.is_dir():
        raise RolloutFolderError(f"rollout folder {folder} does not exist; {fix}")
    if not (folder / META).is_file() or not (folder / ROWS).is_file():
        raise RolloutFolderError(
            f"{folder} is not a rollout folder (needs {META} and {ROWS}); {fix}"
        )
    meta = json.loads((folder / META).read_text())
    pairs, rows = [], 0
    for n, line in enumerate((folder / ROWS).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of an interrupted run; the rollouts tool cuts it on resume
        rows += 1
        if row.get("chosen") is None:
            continue
        c, r = row["samples"][row["chosen"]], row["samples"][row["rejected"]]
        if len(c["tokens"]) != len(c["temps"]) or len(r["tokens"]) != len(r["temps"]):
            raise RolloutFolderError(
                f"{folder / ROWS}:{n + 1}: a sample has {len(c['tokens'])} tokens but "
                f"{len(c['temps'])} temperature indices; regenerate the folder"
            )
        pairs.append(
            {
                "prompt_ids": row["prompt_ids"],
                "kind": row.get("kind") or "default",
                "chosen": {"tokens": c["tokens"], "temps": c["temps"]},
                "rejected": {"tokens": r["tokens"], "temps": r["temps"]},
            }
        )
    if not pairs:
        raise RolloutFolderError(
            f"{folder} holds no chosen/rejected pairs ({rows} prompts, all with tied rewards "
            "or none written); sample more responses per prompt (--samples-per-prompt) or use a "
            "reward that separates them, then rerun the rollouts"
        )
    meta["kinds"] = sorted({p["kind"] for p in pairs})
    return meta, pairs
