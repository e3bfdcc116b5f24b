"""``make gpu-check``: every GPU-facing claim of draftsmith, checked in one run, reported in one
table.

Stages (each timed, each under its own time limit, each failure caught so that it cannot hide the
others):

1. ``setup``: a target folder and a synthetic chat dataset. The converted SmolLM2-135M-Instruct
   target is used when it is already in draftsmith's cache; otherwise (the lent GPU machine cannot
   receive the 98 MB GGUF) a Llama of the same shapes with random weights, and an offline word-level
   tokenizer padded to the same 49,152 entries.
2. ``pytest-gpu``: the test suite's ``gpu``-marked tests (``pytest -m gpu``).
3. ``train:<recipe>``: every standalone recipe trains a few steps through ``train.py``
   (``trainer=gpu``, bf16-mixed) and exports. On CUDA, ``strategy:<preset>``: EAGLE-3 under
   ``trainer=fsdp|deepspeed_zero2| deepspeed_zero3 trainer.devices=1`` (each strategy built and run
   on one GPU).
4. ``runtime-kernels``: the lean decoder with ``kernel_backend="torch"`` vs ``"triton"``: fp32
   parity (logits of a prefill and of a tree-verify forward, greedy tokens) and the decode speed of
   each in the serving dtype.
5. ``bench:<recipe>``: HF ``generate`` vs runtime AR vs speculative decoding with each export, plus
   the fp32 lossless check (greedy speculative == greedy AR).

``--device cpu --tiny`` runs the same stages on a tiny model on the CPU in under a minute (Triton
through its interpreter), which is how the CPU test suite proves this script's logic.

The code is split over this folder's ``gpu_check_core.py`` (plan, stage runner, report),
``gpu_check_train.py`` (setup, gpu tests, training stages) and ``gpu_check_runtime.py`` (kernel and
bench stages); the names the tests use are importable from this module.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

# scripts/ is no package: make the sibling gpu_check_* modules importable however this file is
# loaded (run as a script, or by path through importlib as the tests do).
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)

from gpu_check_core import (  # noqa: E402
    ACCEPTANCE_CAVEAT,
    CHATML,
    NEEDS_INPUT,
    PROMPTS,
    REPO,
    SMOLLM2_SHAPE,
    SPECIALS,
    TINY_SHAPE,
    TINY_TRAIN_EXTRA,
    WORDS,
    Context,
    Plan,
    StageTimeout,
    environment,
    fmt,
    free_memory,
    markdown,
    run_logged,
    run_stage,
    time_limit,
    write_report,
)
from gpu_check_runtime import (  # noqa: E402
    decoder,
    forward_ms,
    hf_reference,
    kernel_parity,
    kernel_speed,
    prefill_and_tree_logits,
    random_tree_mask,
    runtime_ar,
    speculative,
    stage_bench,
    stage_kernels,
    sync,
    torch_dtype,
)
from gpu_check_train import (  # noqa: E402
    STRATEGY_PRESETS,
    build_random_target,
    build_tokenizer,
    converted_target,
    gpu_test_files,
    junit_counts,
    last_json,
    recipe_names,
    stage_pytest,
    stage_setup,
    stage_strategy,
    stage_train,
    synthetic_conversations,
    train_overrides,
)

__all__ = [
    "ACCEPTANCE_CAVEAT",
    "CHATML",
    "NEEDS_INPUT",
    "PROMPTS",
    "REPO",
    "SMOLLM2_SHAPE",
    "SPECIALS",
    "STRATEGY_PRESETS",
    "TINY_SHAPE",
    "TINY_TRAIN_EXTRA",
    "WORDS",
    "Context",
    "Plan",
    "StageTimeout",
    "build_random_target",
    "build_tokenizer",
    "converted_target",
    "decoder",
    "environment",
    "failing",
    "fmt",
    "forward_ms",
    "free_memory",
    "gpu_test_files",
    "hf_reference",
    "junit_counts",
    "kernel_parity",
    "kernel_speed",
    "last_json",
    "main",
    "markdown",
    "parse_args",
    "prefill_and_tree_logits",
    "random_tree_mask",
    "recipe_names",
    "run_logged",
    "run_stage",
    "runtime_ar",
    "speculative",
    "stage_bench",
    "stage_kernels",
    "stage_list",
    "stage_pytest",
    "stage_setup",
    "stage_strategy",
    "stage_train",
    "sync",
    "synthetic_conversations",
    "time_limit",
    "torch_dtype",
    "train_overrides",
    "write_report",
]


def stage_list(
    ctx: Context, limits: dict[str, float]
) -> list[tuple[str, Callable[[Context], dict], float]]:
    """(name, function, time limit) of every stage, recipes listed from the registry. Each recipe's
    bench follows its training, so a run cut short by the device tool's limit (600 s a call) still
    leaves whole (train, bench) pairs; the sharding presets, which train eagle3 again, come last."""
    stages: list[tuple[str, Callable[[Context], dict], float]] = [
        ("setup", stage_setup, limits["setup"]),
        ("pytest-gpu", lambda c: stage_pytest(c, limits["pytest"]), limits["pytest"] + 30),
        ("runtime-kernels", stage_kernels, limits["runtime"]),
    ]
    try:
        recipes = recipe_names(ctx.recipes)
    except Exception as err:  # noqa: BLE001 - reported as its own failed stage
        recipes = []
        stages.append(("recipes", failing(err), 1.0))
    for r in recipes:
        stages.append(
            (f"train:{r}", lambda c, r=r: stage_train(c, r, limits["train"]), limits["train"] + 30)
        )
        stages.append((f"bench:{r}", lambda c, r=r: stage_bench(c, r), limits["runtime"]))
    # the sharding presets need a GPU (the CPU run checks them by inspection)
    if ctx.plan.device == "cuda":
        for preset in STRATEGY_PRESETS:
            stages.append(
                (
                    f"strategy:{preset}",
                    lambda c, p=preset: stage_strategy(c, p, limits["train"]),
                    limits["train"] + 30,
                )
            )
    return stages


def failing(err: Exception) -> Callable[[Context], dict]:
    """A stage function that re-raises ``err`` (a problem found while listing the stages)."""

    def fn(ctx: Context) -> dict:
        raise err

    return fn


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument(
        "--tiny", action="store_true", help="tiny model and sizes (the CPU test uses this)"
    )
    p.add_argument(
        "--out",
        default=os.environ.get("OUT") or str(REPO / "outputs" / "gpu_check"),
        help="folder for gpu_check.json / .md / .log (default $OUT, else outputs/gpu_check)",
    )
    p.add_argument(
        "--work",
        default=None,
        help="scratch folder for the target, data and runs (default OUT/../work)",
    )
    p.add_argument(
        "--target", default=None, help="use this HF folder as the target instead of building one"
    )
    p.add_argument(
        "--random-target",
        action="store_true",
        help="use the random SmolLM2-shaped target even where the converted one is cached",
    )
    p.add_argument(
        "--fail-stage",
        action="append",
        default=[],
        help="make this stage fail (tests the isolation)",
    )
    p.add_argument(
        "--recipes",
        default=None,
        help=(
            "comma-separated recipes to train and bench (default: every "
            "recipe that trains on chat data alone)"
        ),
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        help="run only stages starting with this (repeatable)",
    )
    p.add_argument(
        "--stage-timeout", type=float, default=240.0, help="seconds per training / runtime stage"
    )
    p.add_argument(
        "--pytest-timeout", type=float, default=300.0, help="seconds for the gpu-marked tests"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        # Triton's CPU interpreter must be chosen before triton is first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        import torch

        torch.set_num_threads(1)  # tiny models run faster on one thread than on contended ones
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = (
        Path(args.work)
        if args.work
        else Path(os.environ.get("TMPDIR", "/tmp")) / "draftsmith_gpu_check"
    )
    work.mkdir(parents=True, exist_ok=True)
    log_path = out / "gpu_check.log"
    log_path.write_text("")
    ctx = Context(
        Plan.make(args.device, args.tiny),
        out,
        work,
        log_path,
        set(args.fail_stage),
        random_target=args.random_target,
        target=Path(args.target) if args.target else None,
        recipes=[r for r in args.recipes.split(",") if r] if args.recipes else [],
    )
    limits = {
        "setup": 300.0,
        "pytest": args.pytest_timeout,
        "train": args.stage_timeout,
        "runtime": args.stage_timeout,
    }
    start, env, records = time.perf_counter(), environment(args.device), []
    for name, fn, limit in stage_list(ctx, limits):
        if args.only and name != "setup" and not any(name.startswith(o) for o in args.only):
            continue
        records.append(run_stage(name, fn, ctx, limit))
        # Rewritten after every stage: an outer timeout still leaves the stages that finished.
        report = write_report(ctx, args, env, records, time.perf_counter() - start)
    print(markdown(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
