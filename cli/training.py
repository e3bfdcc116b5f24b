"""Training-side commands: train, bench-train, cache-features (Hydra overrides after the name),
assets (export is :mod:`draftsmith.cli.exporting`)."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path


def _cmd_train(argv: Sequence[str]) -> int:
    """``draftsmith train [--help] recipe=NAME [overrides]``: as ``python train.py``
    (train.run_command_line)."""
    from draftsmith.train import run_command_line

    run_command_line(list(argv), "draftsmith train")
    return 0


def compose_config(overrides: Sequence[str]):
    """Compose ``conf/train.yaml`` with Hydra overrides outside a Hydra app (bench-train, tests)."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    # registers every recipe's schema in Hydra's ConfigStore
    import draftsmith.recipes  # noqa: F401

    with initialize_config_dir(
        config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"
    ):
        return compose("train", overrides=list(overrides))


def _cmd_bench_train(argv: Sequence[str]) -> int:
    """``draftsmith bench-train recipe=NAME [overrides] [--steps N] [--out FILE.json]``."""
    import sys
    from pathlib import Path

    from draftsmith import recipes
    from draftsmith.cli.arguments import COUNT, Range
    from draftsmith.common.errors import ConfigError
    from draftsmith.common.write_rule import OutputRefused, check_file_target
    from draftsmith.distill.engine.bench_train import bench_train

    parser = argparse.ArgumentParser(prog="draftsmith bench-train")
    parser.add_argument("--steps", type=COUNT, default=6, help="timed steps of each part (>= 1)")
    parser.add_argument(
        "--warmup", type=Range(int, low=0), default=2, help="untimed steps before them (>= 0)"
    )
    parser.add_argument("--out", default=None, help="FILE.json (and FILE.md beside it)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    opts, overrides = parser.parse_known_args(argv)
    from draftsmith.cli.train_command_line import expand_shorthands, preflight
    from draftsmith.common.atomic_folder import write_file
    from draftsmith.distill.engine.bench_train import markdown_table
    from draftsmith.train import purposeful_errors

    overrides = expand_shorthands(overrides)
    try:
        # the write rule, before any work: never a folder, nor a file bench-train did not write
        if opts.out:
            for path in (Path(opts.out), Path(opts.out).with_suffix(".md")):
                try:
                    check_file_target(path, owned=_bench_train_output)
                except OutputRefused as err:
                    raise OutputRefused(f"--out {err}") from None
        if (
            problem := preflight(overrides)
        ) is not None:  # typos, types, ranges: before the target loads
            raise ConfigError(problem)
        cfg = compose_config(overrides)
        result = bench_train(
            cfg,
            recipes.get_recipe(cfg.recipe.name),
            steps=opts.steps,
            warmup=opts.warmup,
            device=opts.device,
        )
    except purposeful_errors() as err:
        print(f"draftsmith bench-train: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    text, table = json.dumps(result, indent=2), markdown_table(result)
    print(text)
    print(table)
    if opts.out:
        write_file(opts.out, text + "\n")
        write_file(Path(opts.out).with_suffix(".md"), table + "\n")
    return 0


def _bench_train_output(path: Path) -> bool:
    """Whether ``path`` is what an earlier ``bench-train --out`` wrote (its JSON, or the table
    beside it)."""
    try:
        if path.suffix == ".md":
            return (
                path.read_text().startswith("bench-train: ") and path.with_suffix(".json").is_file()
            )
        return "online_vs_parts" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False


def _cmd_cache_features(argv: list[str]) -> int:
    """``draftsmith cache-features recipe=NAME [overrides] --out DIR [--dtype bf16|fp32] [--shard-mb
    N]``: run the target once over the data and write the features the recipe taps
    (:mod:`draftsmith.distill.feature_cache.build`). Lives in the CLI, not in distill/, because
    composing configs (Hydra) and picking recipes is the entry points' job."""
    from draftsmith import recipes
    from draftsmith.cli.arguments import OneLineParser, Range
    from draftsmith.cli.preflight import check_out_folder
    from draftsmith.cli.train_command_line import expand_shorthands, preflight
    from draftsmith.common.errors import ConfigError
    from draftsmith.distill.feature_cache.build import build_cache
    from draftsmith.train import purposeful_errors, report_error

    parser = OneLineParser(prog="draftsmith cache-features")
    parser.add_argument("--out", required=True, help="cache folder (a re-run resumes there)")
    parser.add_argument(
        "--dtype", default="bf16", choices=("bf16", "fp32"), help="stored feature dtype"
    )
    parser.add_argument(
        "--shard-mb",
        type=Range(float, low=0, low_open=True),
        default=1024.0,
        help="about this many MB per shard",
    )
    opts, overrides = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if (
            problem := preflight(expand_shorthands(overrides))
        ) is not None:  # typos, types, ranges: before loading
            raise ConfigError(problem)
        cfg = compose_config(expand_shorthands(overrides))
        check_out_folder(
            "cache-features", opts.out, (cfg.data.spec, cfg.target.name_or_path)
        )  # before the target
        manifest = build_cache(
            cfg,
            recipes.get_recipe(cfg.recipe.name),
            opts.out,
            dtype=opts.dtype,
            shard_bytes=int(opts.shard_mb * 1e6),
        )
    except purposeful_errors() as err:
        report_error(err)
        return 1
    print(
        json.dumps(
            {k: manifest[k] for k in ("fingerprint", "bytes_per_token", "tokens", "batches")},
            indent=2,
        )
    )
    return 0


def _cmd_assets(args: argparse.Namespace) -> int:
    from draftsmith import assets

    target = assets.default_target_dir(
        full_check=True
    )  # every file against its size and hash at conversion
    conversations, report = assets.read_sharegpt(assets.sharegpt_path())
    questions = assets.mtbench_questions()
    print(
        json.dumps(
            {
                "target": str(target),
                "sharegpt": {
                    "kept": report.kept,
                    "skipped": report.skipped,
                    "turns": report.turns,
                    "reason": report.reason,
                },
                "mtbench_questions": len(questions),
            },
            indent=2,
        )
    )
    return 0


HANDLERS = {"assets": _cmd_assets}
RAW_HANDLERS = {
    "train": _cmd_train,
    "bench-train": _cmd_bench_train,
    "cache-features": _cmd_cache_features,
}
