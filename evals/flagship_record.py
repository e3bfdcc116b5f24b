"""The flagship's ``RECORD.json`` and ``README.md``: how the shipped drafter was trained (hardware,
tokens, wall time, CPU-hours, commands, from its export's lineage), its held-out acceptance by
position and its served speed.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

KEPT_KEYS = (
    "first_position_acceptance",
    "chain_acceptance",
    "conditional_acceptance",
    "verify_steps",
    "generated_tokens",
    "draft_vocab_coverage",
)


def machine() -> str:
    """This machine: CPU model and ISA, cores, and the GPU when there is one."""
    import torch

    from draftsmith.kernels import cpu_caps

    gpu = f"; GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{cpu_caps.probe().describe()}, {os.cpu_count()} cores{gpu}"


def training_block(config: dict[str, Any]) -> dict[str, Any]:
    """What the export's lineage says of its training (an export without one: its own ``training``
    block)."""
    training = config.get("training") or {}
    lineage = training.get("lineage") or {}
    runs = lineage.get("runs") or []
    wall, cpu = lineage.get("wall_seconds_total"), lineage.get("cpu_seconds_total")
    return {
        "tokens": lineage.get("tokens_total", training.get("tokens")),
        "steps": lineage.get("steps_total", training.get("steps")),
        "wall_hours": None if wall is None else round(wall / 3600, 2),
        "cpu_hours": None if cpu is None else round(cpu / 3600, 2),
        "hardware": sorted({m for r in runs for m in r.get("machines") or []}),
        "commands": [r["command"] for r in runs if r.get("command")],
        "runs": len(runs),
        "data_order": lineage.get("data_order"),
    }


def record(
    config: dict[str, Any],
    staged: Path,
    result: dict[str, Any],
    settings: Any,
    cmp: dict[str, Any],
    speed: dict[str, Any] | None,
    source: str,
    shipped_at: str,
) -> dict[str, Any]:
    """The shipped drafter's record."""
    weights = staged / "model.safetensors"
    sets = {s: {k: result[s].get(k) for k in KEPT_KEYS} for s in settings.prompt_sets}
    return {
        "format": "draftsmith-flagship",
        "version": 1,
        "method": config["method"],
        "target": config["target"],
        "weights": {
            "file": weights.name,
            "stored_dtype": "bfloat16",
            "bytes": weights.stat().st_size,
            "sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
        },
        "training": training_block(config),
        "held_out": {
            "settings": asdict(settings),
            "sets": sets,
            "mean_first_position": cmp["candidate_mean"],
            "machine": machine(),
        },
        "served": speed,
        "shipped": {
            "at": shipped_at,
            "source": source,
            "replaced_mean_first_position": cmp["shipped_mean"],
            "gain": cmp["gain"],
        },
    }


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:,}" if isinstance(value, int) else f"{value:.{digits}f}"


def readme(rec: dict[str, Any]) -> str:
    """A short README for the shipped folder, from its record."""
    t, held = rec["training"], rec["held_out"]
    settings = held["settings"]
    lines = [
        f"# Flagship drafter: {rec['method']} for {rec['target'].get('name_or_path')}",
        "",
        (
            "The best drafter this project has trained, kept so that every user and every session"
            " starts from it (`run.init_from=` this folder) instead of from zero. Weights stored"
            f" in bf16 ({rec['weights']['bytes'] / 1e6:.1f} MB); the runtime serves them in its own"
            " dtype."
        ),
        "",
        (
            f"Held-out acceptance ({settings['prompts']} prompts x {settings['max_new_tokens']} new"
            f" tokens per set, greedy, {settings['dtype']}; per position given the earlier ones"
            " were accepted):"
        ),
        "",
        "| prompts | first position | d1 / d2 / d3 / d4 |",
        "|---|---|---|",
    ]
    for name, s in held["sets"].items():
        lines.append(
            f"| {name} | {_num(s['first_position_acceptance'])} | "
            + " / ".join(f"{a:.2f}" for a in s.get("conditional_acceptance") or [])
            + " |"
        )
    lines += [
        "",
        (
            f"Training: {_num(t['tokens'])} tokens, {_num(t['steps'])} steps over {t['runs'] or 1}"
            f" run(s); wall {_num(t['wall_hours'], 2)} h, {_num(t['cpu_hours'], 2)} CPU-h;"
            f" hardware: {'; '.join(t['hardware']) or 'not recorded'}."
        ),
        "",
    ]
    lines += [f"- `{c}`" for c in t["commands"]] or [
        "- command: not recorded (trained before lineage records)"
    ]
    speed = rec.get("served")
    if speed:
        lines += [
            "",
            (
                f"Served ({speed.get('machine')}, {speed.get('prompts')}, {speed.get('dtype')}):"
                f" tau {_num(speed.get('tau'), 2)}, {_num(speed.get('speedup'), 2)}x plain decoding"
                f" {speed.get('interval') or ''}, lossless {speed.get('lossless')}."
            ),
        ]
    lines += [
        "",
        (
            "Reproduce / improve: `make train-best` warm-starts from this folder and offers the"
            " result to `draftsmith flagship ship RUN`, which replaces it only when held-out"
            " first-position acceptance rises by 0.02 or more. Full record: RECORD.json."
        ),
    ]
    return "\n".join(lines) + "\n"


def served_speed(
    staged: Path,
    work: Path,
    prompts: str = "mtbench",
    num_prompts: int = 8,
    max_new_tokens: int = 128,
) -> dict[str, Any] | None:
    """The staged drafter served against plain decoding on this machine (``draftsmith bench``, the
    cost-aware default, lossless checked in fp32), kept in ``work/bench`` so a re-run does not time
    it again; None when the bench fails (the record then says nothing of speed)."""
    import json
    import subprocess
    import sys

    out = work / "bench"
    if not (out / "bench.json").is_file():
        code = subprocess.call(
            [
                sys.executable,
                "-m",
                "draftsmith.cli",
                "bench",
                "--drafter",
                str(staged),
                "--prompts",
                prompts,
                "--num-prompts",
                str(num_prompts),
                "--max-new-tokens",
                str(max_new_tokens),
                "--skip-hf",
                "--lossless-dtype",
                "fp32",
                "--out",
                str(out),
            ]
        )
        if code != 0 or not (out / "bench.json").is_file():
            return None
    result = json.loads((out / "bench.json").read_text())
    speedup = result.get("speedup") or {}
    return {
        "machine": machine(),
        "prompts": f"{prompts} {num_prompts} x {max_new_tokens}",
        "dtype": result.get("dtype"),
        "tau": result.get("tau"),
        "speedup": speedup.get("vs_runtime_ar"),
        "interval": speedup.get("vs_runtime_ar_ci95"),
        "tokens_per_s": result.get("tokens_per_s"),
        "lossless": result.get("lossless"),
    }


def demo_table(bench_dirs: list[str]) -> str:
    """A markdown table, one row per ``draftsmith bench --out DIR`` (``make demo``: the Medusa it
    trains beside the flagship): tau, tokens/s plain and speculative, the speedup with its interval,
    lossless."""
    import json

    lines = [
        (
            "| drafter | method | tau | plain tok/s | speculative tok/s | speedup vs plain |"
            " lossless |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for folder in bench_dirs:
        path = Path(folder) / "bench.json"
        if not path.is_file():
            lines.append(f"| {folder} | - | - | - | - | not benched (no {path}) | - |")
            continue
        r = json.loads(path.read_text())
        tps, speed = r.get("tokens_per_s") or {}, r.get("speedup") or {}
        ci = speed.get("vs_runtime_ar_ci95")
        shown = f"{_num(speed.get('vs_runtime_ar'), 2)}x" + (
            f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
        )
        lines.append(
            f"| {r.get('drafter') or folder} | {r.get('method', '-')} | {_num(r.get('tau'), 2)} | "
            f"{_num(tps.get('runtime_ar'), 1)} | {_num(tps.get('speculative'), 1)} | {shown} | "
            f"{r.get('lossless')} |"
        )
    return "\n".join(lines) + "\n"
