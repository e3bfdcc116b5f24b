"""``draftsmith method-table``: the equal-budget method table. Each recipe is trained for the same
steps on the same batches, its export benched, and one JSON + markdown table + PNG written (tau,
acceptance by position, tokens/s, speedup, extra parameters, training ratio, fit wall time).

Every recipe sees the same data order (same seed, same batches), so equal steps means equal training
tokens. Each stage (training, ``bench-train``, the benches) runs as a ``draftsmith`` subprocess with
its log beside its output, and is skipped when that output already exists, so an interrupted table
resumes where it stopped. The recipes and their labels come from the CLI (recipes/ registrations:
``in_method_table``, ``label``); this module only runs and reads the stages.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.common.atomic_folder import write_file
from draftsmith.common.errors import DraftsmithError

# Default settings (cost-aware stop policy) on the same prompts, timing only: does any export lose
# to plain decoding?
DEFAULT_BENCH_ARGS = (
    "--prompts",
    "mtbench",
    "--num-prompts",
    "8",
    "--max-new-tokens",
    "128",
    "--skip-hf",
    "--lossless-dtype",
    "none",
)
# each method at its own tree or depth (``--stop-policy export``), no tuning, lossless in fp32
TABLE_BENCH_ARGS = (
    "--prompts mtbench --num-prompts 8 --max-new-tokens 128 --stop-policy export --skip-hf"
    " --lossless-dtype fp32"
)


class StageFailed(DraftsmithError, RuntimeError):
    """A stage's subprocess (training, bench-train, a bench) failed; the message names its log."""


@dataclass(frozen=True)
class TableSettings:
    """What every recipe of one table shares: ``steps`` of training, the bench's arguments, which
    specs are also benched with default settings (None: all), whether ``bench-train`` measures the
    training ratio, and the display label of each recipe."""

    out: Path
    steps: int
    bench_args: tuple[str, ...]
    default_bench: frozenset[str] | None
    training_ratio: bool
    labels: dict[str, str]


def draftsmith_command(*args: str) -> list[str]:
    """The argv of a ``draftsmith`` command run by this interpreter (the package it imports)."""
    return [sys.executable, "-m", "draftsmith.cli", *args]


def run_stage(cmd: list[str], log: Path) -> float:
    """Run ``cmd`` with its output in ``log``; returns wall seconds; raises :class:`StageFailed`
    with the log's tail on failure."""
    start = time.perf_counter()
    with log.open("w") as fh:
        code = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT)
    if code != 0:
        tail = " | ".join(log.read_text().splitlines()[-3:])
        raise StageFailed(f"{' '.join(cmd[2:])} failed ({code}); see {log}: {tail}")
    return time.perf_counter() - start


def run_dir_of(spec: str, out: Path) -> Path:
    """``OUT/runs/<recipe>_<override>...``: one folder per spec (``recipe[@override@...]``), each
    override's non-alphanumeric characters as ``-``."""
    recipe, *overrides = spec.split("@")
    cleaned = ("".join(c if c.isalnum() else "-" for c in o) for o in overrides)
    return out / "runs" / "_".join([recipe, *cleaned])


def one_recipe(spec: str, settings: TableSettings) -> dict[str, Any]:
    """Train (or resume) ``spec`` (``recipe[@override@...]``), measure its training ratio (unless
    ``settings.training_ratio`` is False: then the extra parameters are counted in the export),
    bench its export; returns the table row."""
    recipe, *overrides = spec.split("@")
    run_dir = run_dir_of(spec, settings.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    export = run_dir / "export"
    if not (export / "config.json").is_file():
        train = ("train", f"recipe={recipe}", f"trainer.max_steps={settings.steps}", *overrides)
        run_stage(draftsmith_command(*train, f"hydra.run.dir={run_dir}"), run_dir / "train.log")
    ratio_file = run_dir / "bench_train.json"
    if settings.training_ratio and not ratio_file.is_file():
        bench_train = ("bench-train", f"recipe={recipe}", *overrides, "--out", str(ratio_file))
        run_stage(draftsmith_command(*bench_train), run_dir / "bench_train.log")
    bench = _bench_once(export, run_dir / "bench", settings.bench_args)
    # the same export with default settings: the cost-aware policy decides
    default = (
        _bench_once(export, run_dir / "bench_default", DEFAULT_BENCH_ARGS)
        if settings.default_bench is None or spec in settings.default_bench
        else _read_bench(run_dir / "bench_default")
    )
    label = settings.labels.get(recipe, recipe) + (
        f" ({', '.join(overrides)})" if overrides else ""
    )
    return {
        "recipe": spec,
        "method": label,
        **_training_fields(export, ratio_file),
        **_bench_fields(bench, default),
        **served_check(export, run_dir),
    }


def _bench_once(export: Path, out: Path, args: tuple[str, ...]) -> dict[str, Any]:
    """``draftsmith bench export`` of ``export`` into ``out`` unless its bench.json is there;
    returns bench.json."""
    if not (out / "bench.json").is_file():
        cmd = draftsmith_command("bench", "export", "--drafter", str(export), "--out", str(out))
        run_stage([*cmd, *args], out.with_name(f"{out.name}.log"))
    return _read_bench(out)


def _read_bench(out: Path) -> dict[str, Any]:
    """``out``/bench.json, or ``{}`` when that bench did not run."""
    path = out / "bench.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _training_fields(export: Path, ratio_file: Path) -> dict[str, Any]:
    """Steps, tokens and fit time the export records, its extra parameters and training ratio
    (``bench-train``'s, else the parameters counted in the export and no ratio)."""
    training = json.loads((export / "config.json").read_text()).get("training") or {}
    ratio = (
        json.loads(ratio_file.read_text())
        if ratio_file.is_file()
        else {"trainable_params_m": export_params(export) / 1e6, "ratio": None}
    )
    return {
        "steps": training.get("steps"),
        "tokens": training.get("tokens"),
        "fit_seconds": training.get("fit_seconds"),
        "extra_params": ratio.get("trainable_params_m", 0.0) * 1e6,
        "training_ratio": ratio.get("ratio"),
    }


def _bench_fields(bench: dict[str, Any], default: dict[str, Any]) -> dict[str, Any]:
    """The row's bench columns: the export at its own settings, and its speedup at the default
    ones."""
    return {
        "tau": bench["tau"],
        "acceptance_by_position": bench["acceptance_by_position"],
        "tokens_per_s": bench["tokens_per_s"]["speculative"],
        "ar_tokens_per_s": bench["tokens_per_s"]["runtime_ar"],
        "speedup_vs_ar": bench["speedup"]["vs_runtime_ar"],
        "lossless_fp32": bench["lossless"],
        "target_change": bench.get("target_change"),
        "stop_policy": (bench.get("inference") or {}).get("stop_policy"),
        "default_speedup_vs_ar": (default.get("speedup") or {}).get("vs_runtime_ar"),
        "default_choice": (default.get("cost_model") or {}).get("summary"),
    }


def export_params(export: Path) -> int:
    """Parameters stored in an export's safetensors files (the drafter's own: shared target weights
    are not saved)."""
    from safetensors import safe_open

    total = 0
    for file in export.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def served_check(export: Path, run_dir: Path) -> dict[str, Any]:
    """The served tau validation recorded in the export (``validation.served_tau``) next to
    ``draftsmith bench``'s tau on the same prompts and settings (the validation's prompt set, count,
    token budget and dtype; the export's own inference block), and their relative gap: the check
    that what validation promised is what serving gets.
    """
    validation = json.loads((export / "config.json").read_text()).get("validation") or {}
    if validation.get("served_tau") is None:
        return {"served_tau_validation": None, "served_tau_bench": None}
    args = (
        *("--prompts", str(validation.get("prompt_set", "mtbench"))),
        *("--num-prompts", str(validation["prompts"])),
        *("--max-new-tokens", str(validation["max_new_tokens"])),
        *("--dtype", str(validation.get("dtype", "auto"))),
        *("--stop-policy", "export", "--skip-hf", "--lossless-dtype", "none"),
    )
    bench_tau = _bench_once(export, run_dir / "bench_served", args)["tau"]
    return {"served_tau_validation": validation["served_tau"], "served_tau_bench": bench_tau}


def _ratio(ratio: float | None) -> str:
    return "not measured" if ratio is None else f"{ratio:.2f}"


def _x(ratio: float | None) -> str:
    return "not run" if ratio is None else f"{ratio:.2f}x"


def _served(row: dict[str, Any]) -> str:
    val, bench = row.get("served_tau_validation"), row.get("served_tau_bench")
    if val is None or bench is None:
        return "not recorded"
    gap = val / bench - 1
    return f"{val:.3f} / {bench:.3f} ({gap:+.1%}{'' if abs(gap) <= 0.05 else ', OVER 5%'})"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table in markdown (one row per recipe)."""
    head = (
        "| method | tau | acceptance by position | tok/s | speedup vs AR | lossless (fp32) | extra"
        " params | training ratio | fit wall time | tokens | default settings vs AR | served tau:"
        " validation / bench |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = ""
    for r in rows:
        acc = ", ".join(f"{a:.2f}" for a in r["acceptance_by_position"][:5])
        lossless = (
            "lossy (by design)" if r["target_change"] else ("yes" if r["lossless_fp32"] else "NO")
        )
        body += (
            f"| {r['method']} | {r['tau']:.3f} | {acc} | {r['tokens_per_s']:.1f} |"
            f" {r['speedup_vs_ar']:.2f}x | {lossless} | {r['extra_params'] / 1e6:.1f}M |"
            f" {_ratio(r['training_ratio'])} | {r['fit_seconds']:.0f} s | {r['tokens']:,} |"
            f" {_x(r['default_speedup_vs_ar'])} | {_served(r)} |\n"
        )
    return head + body


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Acceptance by position per method, and tau, written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        curve = r["acceptance_by_position"]
        left.plot(range(1, len(curve) + 1), curve, marker="o", label=r["method"])
    left.set_xlabel("draft position")
    left.set_ylabel("acceptance rate")
    left.legend(fontsize=7)
    right.bar([r["method"] for r in rows], [r["tau"] for r in rows])
    right.set_ylabel("tau (accepted + bonus per step)")
    right.tick_params(axis="x", rotation=45, labelsize=7)
    fig.tight_layout()
    write_file(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def run_table(specs: list[str], settings: TableSettings) -> list[dict[str, Any]]:
    """Every spec in turn (``table.json`` rewritten after each, so a resumed table keeps them), then
    ``table.md`` and ``table.png``; returns the rows."""
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for spec in specs:
        print(f"[method-table] {spec} ...", flush=True)
        rows.append(one_recipe(spec, settings))
        write_file(out / "table.json", json.dumps(rows, indent=2) + "\n")
        print(markdown(rows[-1:]), flush=True)
    write_file(out / "table.md", markdown(rows))
    plot(rows, out / "table.png")
    return rows
