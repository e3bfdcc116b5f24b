"""``draftsmith rollouts``: preference pairs for adaptive-temperature (LPO) training, from the
decoder's own samples.

Per prompt: sample N responses in one batch with the current adaptive decoder (``--controller
EXPORT``: the head SAMPLES a temperature index from its softmax, per response or per token, because
LPO learns from the decoder's own random choices) or, in the first round, with uniformly random grid
temperatures; record the temperature index of every generated token; score each response with the
reward; the best is ``chosen`` and the worst ``rejected`` (a prompt whose N rewards all tie gives no
pair and is counted).

Output folder: ``meta.json`` (settings, written first) and ``rollouts.jsonl``, one line per prompt:
``{"prompt_index", "id", "kind", "text", "answer", "prompt_ids", "samples": [{"tokens", "temps",
"reward", "response"}], "chosen", "rejected"}`` where ``temps[t]`` is the grid index that sampled
``tokens[t]``. Lines are appended and flushed one prompt at a time; a rerun with the same settings
drops a torn last line, skips the prompts already written and continues, and each prompt's sampling
generator is seeded from (seed, prompt index), so a resumed folder holds the same rows as an
uninterrupted run. Other settings in the same folder are refused.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from draftsmith.common.errors import DraftsmithError
from draftsmith.controllers.adaptive_temperature import AdaptiveTemperatureHead
from draftsmith.datagen.resumable_folder import start_folder
from draftsmith.datagen.rewards import Reward, score
from draftsmith.datagen.rollout_folder import META, ROWS  # the format this writes
from draftsmith.datagen.rollout_sampling import sample_group


class RolloutError(DraftsmithError, ValueError):
    """A rollout folder cannot be written as asked (one actionable message)."""


def settings(
    target: str,
    grid: Sequence[float],
    granularity: str,
    n: int,
    max_new_tokens: int,
    reward: str,
    seed: int,
    prompts: str,
    num_prompts: int,
    controller: str | None,
) -> dict[str, Any]:
    """What identifies a rollout folder (a resumed run must match every field)."""
    return {
        "target": target,
        "grid": list(grid),
        "granularity": granularity,
        "samples_per_prompt": n,
        "max_new_tokens": max_new_tokens,
        "reward": reward,
        "seed": seed,
        "prompts": prompts,
        "num_prompts": num_prompts,
        "controller": controller,
    }


def _done_rows(path: Path) -> list[dict]:
    """Complete rows of a rollouts file; a torn last line (interrupted write) is cut off the
    file."""
    if not path.is_file():
        return []
    raw = path.read_bytes()
    keep = raw[: raw.rfind(b"\n") + 1]
    if len(keep) != len(raw):
        path.write_bytes(keep)
    return [json.loads(line) for line in keep.decode().splitlines() if line.strip()]


def pick_pair(rewards: Sequence[float]) -> tuple[int | None, int | None]:
    """(chosen, rejected) = (first best, last worst) sample, or (None, None) when every reward
    ties."""
    best, worst = max(rewards), min(rewards)
    if best == worst:
        return None, None
    return rewards.index(best), len(rewards) - 1 - list(reversed(rewards)).index(worst)


def write_rollouts(
    model: Any,
    prompts: list[dict],
    out: str | Path,
    reward: Reward,
    decode: Callable[[list[int]], str],
    meta: dict[str, Any],
    head: AdaptiveTemperatureHead | None = None,
    eos_ids: Sequence[int] = (),
    progress: bool = True,
) -> dict[str, Any]:
    """Write (or resume) the rollouts of ``prompts`` (records with ``ids``, ``text``, ``kind``,
    ``answer``) into ``out``; ``meta`` from :func:`settings`. Returns counts."""
    out = Path(out)
    start_folder(out, META, meta, "rollouts", RolloutError)
    done = {int(r["prompt_index"]) for r in _done_rows(out / ROWS)}
    bar = _progress(len(prompts), len(done), progress)
    new = 0
    with (out / ROWS).open("a") as handle:
        for i, prompt in enumerate(prompts):
            if i in done:
                continue
            gen = torch.Generator().manual_seed(int(meta["seed"]) * 1_000_003 + i)
            group = sample_group(
                model,
                prompt["ids"],
                int(meta["samples_per_prompt"]),
                meta["grid"],
                meta["granularity"],
                head,
                int(meta["max_new_tokens"]),
                eos_ids,
                gen,
            )
            line = _scored_row(i, prompt, group, reward, decode, meta["reward"])
            handle.write(json.dumps(line) + "\n")
            handle.flush()
            new += 1
            bar(1)
    rows = _done_rows(out / ROWS)
    pairs = sum(r["chosen"] is not None for r in rows)
    return {
        "prompts": len(prompts),
        "resumed": len(done),
        "written": new,
        "pairs": pairs,
        "ties": len(rows) - pairs,
        "out": str(out),
    }


def _scored_row(
    index: int,
    prompt: dict,
    group: list[tuple[list[int], list[int]]],
    reward: Reward,
    decode: Callable[[list[int]], str],
    reward_name: str,
) -> dict[str, Any]:
    """The ``rollouts.jsonl`` line of prompt ``index``: its samples decoded and scored, and the
    chosen/rejected pair (None, None when every reward ties)."""
    record = {k: prompt.get(k) for k in ("id", "kind", "text", "answer")}
    samples = []
    for toks, idx in group:
        text = decode(toks)
        samples.append(
            {
                "tokens": toks,
                "temps": idx,
                "reward": score(reward, record, text, reward_name),
                "response": text,
            }
        )
    chosen, rejected = pick_pair([s["reward"] for s in samples])
    return {
        "prompt_index": index,
        **record,
        "prompt_ids": list(prompt["ids"]),
        "samples": samples,
        "chosen": chosen,
        "rejected": rejected,
    }


def _progress(total: int, initial: int, enabled: bool) -> Callable[[int], None]:
    if not enabled:
        return lambda k: None
    try:
        from tqdm import tqdm
    except ImportError:
        state = {"n": initial}

        def plain(k: int) -> None:
            state["n"] += k
            print(
                f"\rrollouts {state['n']}/{total}",
                end="" if state["n"] < total else "\n",
                file=sys.stderr,
            )

        return plain
    bar = tqdm(total=total, initial=initial, desc="rollouts", unit="prompt", file=sys.stderr)
    return bar.update
