"""Checks the commands run on their paths before anything loads: an export that is a file, a model,
a speculators checkpoint or a converted layout; a target that is an export or ships code that would
run without ``--trust-remote-code``; an output path the write rule refuses
(:mod:`draftsmith.common.write_rule`: never over or into an input, never over a folder or file of
the user's, never where it cannot be written). Each refusal is one line naming the input, the
problem and the fix (ranges of numeric flags are declared with the flags:
:mod:`draftsmith.cli.arguments`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftsmith.common.atomic_folder import OutputKind, check_folder_target
from draftsmith.common.errors import InputError

RESULT_MARKS = (
    "bench.json",
    "controller.json",
    "reward_eval.json",
    "diffusion_bench.json",
    "calibration.json",
)


def _has(*names: str):
    return lambda folder: any((folder / name).exists() for name in names)


# command -> the kind of folder its --out is (what it writes there; a folder of the user's is
# refused)
OUTPUT_KINDS = {
    "bench": OutputKind("bench output", _has(*RESULT_MARKS), ("*.json", "*.md", "*.png")),
    "calibrate": OutputKind("calibration output", _has(*RESULT_MARKS), ("*.json", "*.md", "*.png")),
    "rollouts": OutputKind(
        "rollout folder", _has("meta.json", "rollouts.jsonl"), ("meta.json", "rollouts.jsonl")
    ),
    "trajectories": OutputKind(
        "trajectory folder", _has("meta.json"), ("meta.json", "shard-*.safetensors", ".shard-*")
    ),
    "curve": OutputKind(
        "learning-curve folder", _has("curve.json", "compare.json", "run", "points")
    ),
    "cache-features": OutputKind("feature cache", _has("manifest.json", "cache.json")),
    # training runs, benches and their logs under runs/; the table beside them
    "method-table": OutputKind(
        "method table",
        _has("table.json", "runs"),
        ("table.json", "table.md", "table.png", ".table.*", "runs/*"),
    ),
}


def check_out_folder(
    command: str, out: str | Path, inputs: tuple[str | Path | None, ...] = (), flag: str = "--out"
) -> Path:
    """Refuse, before any work, an output folder ``command`` must not write (a file, an input or a
    folder around or inside one, a folder of the user's, a read-only place); returns it resolved."""
    return check_folder_target(out, OUTPUT_KINDS[command], tuple(i for i in inputs if i), flag)


def target_of(args: argparse.Namespace) -> str | None:
    """The target folder a serving command will load: ``--target`` (alias resolved), else the one
    the drafter's (or controller's) export records; None when that cannot be read here (the loader
    names the problem).
    """
    from draftsmith import assets

    given = getattr(args, "target", None)
    for flag in ("drafter", "controller"):
        if given:
            break
        export = str(getattr(args, flag, None) or "").split(",")[0]
        try:
            given = (
                json.loads((Path(export) / "config.json").read_text())["target"]["name_or_path"]
                if export
                else None
            )
        except (OSError, ValueError, KeyError, TypeError):
            given = None
    return str(assets.resolve_target(str(given))) if given else None


def refuse_bad_exports(args: argparse.Namespace) -> None:
    """Refuse, before any model loads, a ``--drafter`` / ``--controller`` that is not a draftsmith
    export (a file, a target model, a speculators checkpoint, a layout converted for another
    engine...), a ``--target`` that is not a model folder, and a target whose own code would run
    without ``--trust-remote-code``."""
    from draftsmith.common.remote_code import refuse_remote_code
    from draftsmith.export.folder_kinds import drafter_problem, target_problem

    for flag in ("--drafter", "--controller"):
        for given in filter(None, str(getattr(args, flag[2:], None) or "").split(",")):
            if problem := drafter_problem(flag, given):
                raise InputError(problem)
    target = target_of(args)
    if target and (
        problem := target_problem(
            "--target" if getattr(args, "target", None) else "the export's recorded target", target
        )
    ):
        raise InputError(problem)
    if target:
        refuse_remote_code(target, bool(getattr(args, "trust_remote_code", False)))


def check_new_tokens_fit(
    prompt_tokens: int, max_new_tokens: int | None, limit: int | None, what: str
) -> None:
    """Refuse a ``--max-new-tokens`` that cannot fit after the longest prompt in the target's
    context (10**9 used to end in an allocator error, a few thousand past the context in garbage
    positions)."""
    if limit is not None and max_new_tokens and prompt_tokens + max_new_tokens > limit:
        raise InputError(
            f"--max-new-tokens {max_new_tokens} does not fit: {what} has {prompt_tokens} tokens and"
            f" the target's context is {limit} positions; pass --max-new-tokens"
            f" {limit - prompt_tokens} or fewer"
        )


def add_trust_flag(p: argparse.ArgumentParser) -> None:
    """``--trust-remote-code``: the opt-in every command that loads a target has (off by
    default)."""
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help=(
            "let a target folder that ships its own Python code (config.json auto_map) run it; off"
            " by default: such a folder is refused in one line"
        ),
    )


__all__ = [
    "OUTPUT_KINDS",
    "add_trust_flag",
    "check_new_tokens_fit",
    "check_out_folder",
    "refuse_bad_exports",
    "target_of",
]
