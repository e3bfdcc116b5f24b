"""Equal-budget method table: train each recipe for the same steps on the same batches, bench each
export, and write one JSON + markdown table + PNG (tau, acceptance by position, tokens/s, speedup,
extra parameters, training ratio, fit wall time).

    python scripts/method_table.py --steps 80 --out outputs/method_table  # all head-family + EAGLE
    python scripts/method_table.py --recipes medusa,eagle3 --steps 40 --out /tmp/t  # a subset
    # a recipe with overrides:
    python scripts/method_table.py --recipes medusa@heads.draft_vocab_size=8192

Every recipe sees the same data order (same seed, same batches), so equal steps means equal training
tokens; each stage is skipped when its output already exists, so an interrupted table resumes where
it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from draftsmith.recipes import labels, method_table_recipes

ROOT = Path(__file__).resolve().parents[1]
# Recipes and labels come from the recipes' registrations (recipes/<name>/__init__.py:
# in_method_table, label).
DEFAULT_RECIPES = ",".join(method_table_recipes())
DRAFTSMITH = str(Path(sys.executable).with_name("draftsmith"))  # the console script of this venv
# Default settings (cost-aware stop policy) on the same prompts, timing only: does any export lose
# to plain decoding?
DEFAULT_BENCH_ARGS = [
    "--prompts",
    "mtbench",
    "--num-prompts",
    "8",
    "--max-new-tokens",
    "128",
    "--skip-hf",
    "--lossless-dtype",
    "none",
]
LABELS = labels()


def _run(cmd: list[str], log: Path) -> float:
    """Run ``cmd`` with its output in ``log``; returns wall seconds; raises with the log's tail on
    failure."""
    start = time.perf_counter()
    with log.open("w") as fh:
        code = subprocess.call(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd)} failed ({code}); see {log}:\n{tail}")
    return time.perf_counter() - start


def one_recipe(
    spec: str,
    out: Path,
    steps: int,
    bench_args: list[str],
    default_bench: bool = True,
    training_ratio: bool = True,
) -> dict[str, Any]:
    """Train (or resume) ``spec`` (``recipe[@override@...]``), measure its training ratio (unless
    ``training_ratio`` is False: then the extra parameters are counted in the export), bench its
    export; returns the table row."""
    recipe, *overrides = spec.split("@")
    run_dir = (
        out
        / "runs"
        / "_".join([recipe, *("".join(c if c.isalnum() else "-" for c in o) for o in overrides)])
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    export = run_dir / "export"
    if not (export / "config.json").is_file():
        _run(
            [
                sys.executable,
                "train.py",
                f"recipe={recipe}",
                f"trainer.max_steps={steps}",
                *overrides,
                f"hydra.run.dir={run_dir}",
            ],
            run_dir / "train.log",
        )
    ratio_file = run_dir / "bench_train.json"
    if training_ratio and not ratio_file.is_file():
        _run(
            [DRAFTSMITH, "bench-train", f"recipe={recipe}", *overrides, "--out", str(ratio_file)],
            run_dir / "bench_train.log",
        )
    bench_dir = run_dir / "bench"
    if not (bench_dir / "bench.json").is_file():
        _run(
            [DRAFTSMITH, "bench", "--drafter", str(export), "--out", str(bench_dir), *bench_args],
            run_dir / "bench.log",
        )
    default_dir = (
        run_dir / "bench_default"
    )  # the same export with default settings: the cost-aware policy decides
    if default_bench and not (default_dir / "bench.json").is_file():
        _run(
            [
                DRAFTSMITH,
                "bench",
                "--drafter",
                str(export),
                "--out",
                str(default_dir),
                *DEFAULT_BENCH_ARGS,
            ],
            run_dir / "bench_default.log",
        )
    default = (
        json.loads((default_dir / "bench.json").read_text())
        if (default_dir / "bench.json").is_file()
        else {}
    )
    served = served_check(export, run_dir)
    training = json.loads((export / "config.json").read_text()).get("training") or {}
    ratio = (
        json.loads(ratio_file.read_text())
        if ratio_file.is_file()
        else {"trainable_params_m": export_params(export) / 1e6, "ratio": None}
    )
    bench = json.loads((bench_dir / "bench.json").read_text())
    label = LABELS.get(recipe, recipe) + (f" ({', '.join(overrides)})" if overrides else "")
    return {
        "recipe": spec,
        "method": label,
        "steps": training.get("steps"),
        "tokens": training.get("tokens"),
        "fit_seconds": training.get("fit_seconds"),
        "extra_params": ratio.get("trainable_params_m", 0.0) * 1e6,
        "training_ratio": ratio.get("ratio"),
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
        **served,
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
    out = run_dir / "bench_served"
    if not (out / "bench.json").is_file():
        _run(
            [
                DRAFTSMITH,
                "bench",
                "--drafter",
                str(export),
                "--out",
                str(out),
                "--prompts",
                str(validation.get("prompt_set", "mtbench")),
                "--num-prompts",
                str(validation["prompts"]),
                "--max-new-tokens",
                str(validation["max_new_tokens"]),
                "--dtype",
                str(validation.get("dtype", "auto")),
                "--stop-policy",
                "export",
                "--skip-hf",
                "--lossless-dtype",
                "none",
            ],
            run_dir / "bench_served.log",
        )
    bench_tau = json.loads((out / "bench.json").read_text())["tau"]
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
    """The README table."""
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
    """Acceptance by position per method, and tau."""
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
    fig.savefig(path, dpi=120)


def main() -> int:
    """CLI entry: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default=DEFAULT_RECIPES)
    parser.add_argument(
        "--steps", type=int, default=80, help="optimizer steps per recipe (the same batches each)"
    )
    parser.add_argument("--out", default="outputs/method_table")
    parser.add_argument(
        "--bench-args",
        default=(
            "--prompts mtbench --num-prompts 8 --max-new-tokens 128 "
            "--stop-policy export --skip-hf --lossless-dtype fp32"
        ),
        help="arguments for `draftsmith bench` (export = each method's own tree/depth, no tuning)",
    )
    parser.add_argument(
        "--default-bench",
        default="all",
        help="specs also benched with default settings (cost-aware policy): all, none or a list",
    )
    parser.add_argument(
        "--skip-training-ratio",
        action="store_true",
        help=(
            "skip `draftsmith bench-train` per recipe (extra parameters are counted in the export)"
        ),
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for recipe in args.recipes.split(","):
        print(f"[method-table] {recipe} ...", flush=True)
        default_bench = args.default_bench == "all" or recipe in args.default_bench.split(",")
        rows.append(
            one_recipe(
                recipe,
                out,
                args.steps,
                args.bench_args.split(),
                default_bench,
                not args.skip_training_ratio,
            )
        )
        (out / "table.json").write_text(json.dumps(rows, indent=2) + "\n")
        print(markdown(rows[-1:]), flush=True)
    (out / "table.md").write_text(markdown(rows))
    plot(rows, out / "table.png")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
