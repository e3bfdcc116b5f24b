"""``draftsmith bench reward --controller ... --prompts embedded:heldout``: what an
adaptive-temperature layer buys.

Every fixed temperature of the layer's grid and every layer ("condition") samples ``samples``
responses per prompt of a reward task; each response is scored with the task's reward. A layer is
served as it is deployed (its argmax temperature, per response or per token). All conditions share
the sampling seed of each prompt (common random numbers), so differences between conditions are
paired by prompt and their confidence intervals are narrow.

Reported per condition and prompt kind: the mean reward with a 95% bootstrap interval over prompts,
the mean temperature used, and for each layer the paired difference to every fixed temperature on
the whole mixed set (the paper's claim: the layer beats the best fixed temperature). Each
condition's raw rows are kept in ``<out>/conditions/<name>.json`` with the settings that made them,
so a rerun (or one that adds a layer) samples only what is missing.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from draftsmith.controllers.adaptive_temperature import AdaptiveTemperatureHead
from draftsmith.datagen.rewards import Reward, score
from draftsmith.datagen.rollout_sampling import sample_group

BOOTSTRAP_DRAWS = 2000


def fixed_name(temperature: float) -> str:
    """The condition name of a fixed temperature (``T=0.4``)."""
    return f"T={temperature:g}"


@torch.no_grad()
def sample_condition(
    model: Any,
    records: Sequence[dict],
    reward: Reward,
    reward_name: str,
    decode: Callable[[list[int]], str],
    samples: int,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    seed: int,
    temperature: float | None = None,
    head: AdaptiveTemperatureHead | None = None,
    progress: Callable[[int], None] = lambda k: None,
    first_index: int = 0,
) -> list[dict]:
    """One row per prompt: ``{"id", "kind", "rewards" [samples], "temperature"}`` (mean temperature
    used per sample, averaged), at a fixed ``temperature`` or with ``head``'s argmax choices. Prompt
    ``i`` of ``records`` is sampled with the seed of prompt ``first_index + i`` of the whole set."""
    if (temperature is None) == (head is None):
        raise ValueError("give exactly one of temperature and head")
    grid = list(head.config.grid) if head is not None else [float(temperature)]
    granularity = head.config.granularity if head is not None else "sequence"
    rows = []
    for i, record in enumerate(records):
        gen = torch.Generator().manual_seed(
            seed * 1_000_003 + first_index + i
        )  # the same draws in every condition
        n = 1 if temperature == 0 else samples  # greedy: every sample would be the same response
        group = sample_group(
            model,
            record["ids"],
            n,
            grid,
            granularity,
            head,
            max_new_tokens,
            eos_ids,
            gen,
            choice="greedy",
        )
        rewards = [score(reward, record, decode(tokens), reward_name) for tokens, _ in group]
        temps = [
            sum(grid[k] for k in idx) / max(len(idx), 1) for _, idx in group
        ]  # mean T used per sample
        rows.append(
            {
                "id": record["id"],
                "kind": record["kind"],
                "rewards": rewards * (samples // n),
                "temperature": sum(temps) / len(temps),
            }
        )
        progress(1)
    return rows


def bootstrap_ci(values: Sequence[float], seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of ``values`` (resampling the values)."""
    if len(values) < 2:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    n = len(values)
    means = sorted(
        sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(BOOTSTRAP_DRAWS)
    )
    return means[int(0.025 * BOOTSTRAP_DRAWS)], means[int(0.975 * BOOTSTRAP_DRAWS) - 1]


def _prompt_means(rows: Sequence[dict], kind: str | None = None) -> list[float]:
    return [
        sum(r["rewards"]) / len(r["rewards"]) for r in rows if kind is None or r["kind"] == kind
    ]


def summarize(conditions: dict[str, list[dict]], layers: Sequence[str]) -> dict[str, Any]:
    """Per condition: mean reward and 95% CI over prompts, overall and per kind, and the mean
    temperature per kind; per layer: paired differences (layer - fixed) over prompts to every fixed
    temperature, with their CIs.
    """
    first = next(iter(conditions.values()))
    kinds = sorted({r["kind"] for r in first})
    table: dict[str, Any] = {}
    for name, rows in conditions.items():
        if [r["id"] for r in rows] != [r["id"] for r in first]:
            raise ValueError(
                f"condition {name} was sampled on other prompts than {next(iter(conditions))}"
            )
        entry: dict[str, Any] = {"all": _stat(_prompt_means(rows))}
        for kind in kinds:
            entry[kind] = _stat(_prompt_means(rows, kind))
            picked = [r["temperature"] for r in rows if r["kind"] == kind]
            entry[kind]["mean_temperature"] = sum(picked) / len(picked)
        table[name] = entry
    fixed = [name for name in conditions if name not in layers]
    best = max(fixed, key=lambda name: table[name]["all"]["mean"]) if fixed else None
    versus: dict[str, Any] = {}
    for layer in layers:
        mine = _prompt_means(conditions[layer])
        versus[layer] = {}
        for name in fixed:
            diff = [a - b for a, b in zip(mine, _prompt_means(conditions[name]))]
            versus[layer][name] = _stat(diff)
        versus[layer]["beats_every_fixed"] = all(versus[layer][name]["mean"] > 0 for name in fixed)
        versus[layer]["significantly"] = all(versus[layer][name]["ci95"][0] > 0 for name in fixed)
    best_by_kind = (
        {kind: max(fixed, key=lambda name: table[name][kind]["mean"]) for kind in kinds}
        if fixed
        else {}
    )
    return {
        "kinds": kinds,
        "prompts": len(first),
        "table": table,
        "best_fixed": best,
        "best_fixed_by_kind": best_by_kind,
        "layer_vs_fixed": versus,
    }


def _stat(values: Sequence[float]) -> dict[str, Any]:
    return {
        "mean": sum(values) / len(values),
        "ci95": list(bootstrap_ci(values)),
        "prompts": len(values),
    }


def reward_table(summary: dict[str, Any]) -> str:
    """Markdown: one row per condition, the mixed set and each kind (mean [95% CI], mean T), then
    the layers' paired differences to each fixed temperature."""
    kinds = summary["kinds"]
    head = (
        "| condition | mixed set | "
        + " | ".join(kinds)
        + " |\n|---|---|"
        + "---|" * len(kinds)
        + "\n"
    )
    lines = []
    for name, entry in summary["table"].items():
        cells = [_cell(entry["all"])] + [
            f"{_cell(entry[k])}, T {entry[k]['mean_temperature']:.2f}" for k in kinds
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    out = head + "\n".join(lines) + "\n"
    for layer, diffs in summary["layer_vs_fixed"].items():
        out += (
            f"\n{layer} minus each fixed temperature (mixed set, paired by prompt): "
            + ", ".join(f"{n} {_cell(d)}" for n, d in diffs.items() if isinstance(d, dict))
            + f". Beats every fixed temperature: {'yes' if diffs['beats_every_fixed'] else 'no'}"
            + f" (all intervals above 0: {'yes' if diffs['significantly'] else 'no'}).\n"
        )
    return out


def _cell(stat: dict[str, Any]) -> str:
    lo, hi = stat["ci95"]
    return f"{stat['mean']:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def plot(summary: dict[str, Any], path: str | Path) -> Path | None:
    """Grouped bars: mean reward per kind and condition with 95% intervals (None when matplotlib is
    missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups = ["all", *summary["kinds"]]
    names = list(summary["table"])
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(groups), 3.6))
    for j, name in enumerate(names):
        stats = [summary["table"][name][g] for g in groups]
        means = [s["mean"] for s in stats]
        errs = [
            [max(s["mean"] - s["ci95"][0], 0) for s in stats],
            [max(s["ci95"][1] - s["mean"], 0) for s in stats],
        ]
        ax.bar(
            [g + (j - (len(names) - 1) / 2) * width for g in range(len(groups))],
            means,
            width,
            yerr=errs,
            capsize=2,
            label=name,
        )
    ax.set_xticks(range(len(groups)), ["mixed set" if g == "all" else g for g in groups])
    ax.set_ylabel("mean reward (95% CI over prompts)")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def evaluate(
    model: Any,
    records: Sequence[dict],
    layers: dict[str, tuple[AdaptiveTemperatureHead, str]],
    grid: Sequence[float],
    reward: Reward,
    reward_name: str,
    decode: Callable[[list[int]], str],
    samples: int,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    seed: int,
    out: str | Path | None,
    settings: dict[str, Any],
    progress: bool = True,
) -> dict[str, Any]:
    """Sample every fixed temperature of ``grid`` and every layer (``name -> (head, fingerprint of
    its weights)``) on ``records`` and summarize them. Rows cached in ``out`` under the same
    ``settings`` and fingerprint are reused per prompt (keyed by prompt id and text; a prompt's seed
    is its id's position among the cached ones), so a larger prompt set or an interrupted run
    samples only what is missing."""
    todo: list[tuple[str, float | None, AdaptiveTemperatureHead | None, str]] = [
        (fixed_name(t), t, None, fixed_name(t)) for t in grid
    ]
    todo += [(name, None, head, print_) for name, (head, print_) in layers.items()]
    cache = Path(out) / "conditions" if out else None
    keys = [f"{r['id']}\t{r['text']}" for r in records]
    plan = []
    for name, temperature, head, print_ in todo:
        saved = _saved_rows(cache, name, {**settings, "condition": print_})
        missing = [i for i, k in enumerate(keys) if k not in saved]
        plan.append((name, temperature, head, print_, saved, missing))
    bar = _progress(sum(len(p[-1]) for p in plan), progress)
    conditions: dict[str, list[dict]] = {}
    sampled = []
    for name, temperature, head, print_, saved, missing in plan:
        for i in missing:  # one prompt at a time, saved atomically after each
            row = sample_condition(
                model,
                [records[i]],
                reward,
                reward_name,
                decode,
                samples,
                max_new_tokens,
                eos_ids,
                seed,
                temperature,
                head,
                bar,
                first_index=i,
            )[0]
            saved[keys[i]] = row
            _save_rows(cache, name, {**settings, "condition": print_}, saved)
        if missing:
            sampled.append(name)
        conditions[name] = [saved[k] for k in keys]
    return {"settings": settings, **summarize(conditions, list(layers)), "sampled": sampled}


def _saved_rows(cache: Path | None, name: str, settings: dict[str, Any]) -> dict[str, dict]:
    """The rows of condition ``name`` kept in ``cache`` under the same ``settings`` (by prompt key),
    else none."""
    path = cache / f"{name}.json" if cache else None
    if path is None or not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if data.get("settings") == settings and isinstance(data.get("rows"), dict):
        return data["rows"]
    return {}


def _save_rows(
    cache: Path | None, name: str, settings: dict[str, Any], rows: dict[str, dict]
) -> None:
    """Keep condition ``name``'s rows in ``cache`` (written beside, then renamed over)."""
    if cache is None:
        return
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{name}.json.tmp"
    tmp.write_text(json.dumps({"settings": settings, "rows": rows}) + "\n")
    tmp.replace(cache / f"{name}.json")


def _progress(total: int, enabled: bool) -> Callable[[int], None]:
    if not enabled or total == 0:
        return lambda k: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc="reward eval", unit="prompt", file=sys.stderr)
    return bar.update
