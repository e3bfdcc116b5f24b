"""Data and evaluation commands: regenerate, rollouts, trajectories, diffusion-export (training-data
producers in ``datagen/``) and calibrate (an evaluation in ``evals/``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftsmith.cli.arguments import COUNT, SEED, TEMPERATURE, TOP_P, Range, counts, served_dtype
from draftsmith.cli.preflight import add_trust_flag, check_out_folder, refuse_bad_exports, target_of


def _regenerate_arguments(r: argparse.ArgumentParser) -> None:
    """``regenerate``: its input and output, which conversations and how long the answers, how they
    are decoded, and whether the target may run its own code."""
    r.add_argument(
        "--data", default="sharegpt", help="sharegpt (embedded) or a .jsonl/.json of conversations"
    )
    r.add_argument(
        "--out",
        required=True,
        help=(
            "output .jsonl ({messages, source_index} per line; a new file: "
            "never the data or an existing file); resumes OUT.partial"
        ),
    )
    r.add_argument("--overwrite", action="store_true", help="replace --out when it exists")
    r.add_argument(
        "--target", default=None, help="target folder (default: the embedded smollm2-135m)"
    )
    _regenerate_selection_flags(r)
    _regenerate_decoding_flags(r)
    add_trust_flag(r)


def _regenerate_selection_flags(r: argparse.ArgumentParser) -> None:
    """Which conversations ``regenerate`` rewrites, and how many tokens each answer may take."""
    r.add_argument(
        "--limit",
        type=counts("leave it out to use every conversation"),
        default=None,
        help="use the first N conversations (of those selected)",
    )
    r.add_argument(
        "--topic",
        default="all",
        choices=["all", "code"],
        help=(
            "only conversations whose first user message is on this topic (code: names a language,"
            " shows code or asks for a function)"
        ),
    )
    r.add_argument(
        "--skip",
        type=Range(int, low=0, hint="a source index"),
        default=0,
        help="start at this source index (a second set past the records a first one used)",
    )
    r.add_argument("--max-new-tokens", type=COUNT, default=256)
    r.add_argument(
        "--max-prompt-tokens",
        type=COUNT,
        default=None,
        help=(
            "only conversations whose first prompt has at most N tokens (a run training at"
            " data.max_length L learns little behind a prompt of ~L tokens; long prefills are most"
            " of batched regeneration's time); --limit counts the kept ones"
        ),
    )


def _regenerate_decoding_flags(r: argparse.ArgumentParser) -> None:
    """How ``regenerate`` decodes: sampling, turns, dtype, kernels, seed and batch size."""
    r.add_argument("--temperature", type=TEMPERATURE, default=0.0)
    r.add_argument("--top-p", type=TOP_P, default=1.0)
    r.add_argument(
        "--turns",
        default="first",
        choices=["first", "all"],
        help=(
            "regenerate the first assistant turn only, or all with the target's own replies in"
            " context"
        ),
    )
    r.add_argument(
        "--dtype", default="bf16", type=served_dtype, help="bf16 (faster on CPU) or fp32"
    )
    r.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"])
    r.add_argument("--seed", type=SEED, default=0)
    r.add_argument(
        "--batch-size",
        type=counts("1 decodes one conversation at a time"),
        default=8,
        help=(
            "greedy first turns decoded at once (default 8; 1 = one at a time). --turns all and"
            " --temperature > 0 decode one conversation at a time (logged); a resume needs the same"
            " value"
        ),
    )


def _calibrate_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("--drafter", required=True, help="a SpecDec++ export folder")
    c.add_argument(
        "--prompts", default="mtbench", help="mtbench or a .jsonl with 'prompt' (or 'turns')"
    )
    c.add_argument("--out", required=True, help="folder for calibration.json and reliability.png")
    c.add_argument(
        "--target", default=None, help="target folder (default: the one recorded in the export)"
    )
    c.add_argument("--num-prompts", type=counts("leave it out to use every prompt"), default=None)
    c.add_argument("--max-new-tokens", type=COUNT, default=128)
    c.add_argument(
        "--depth",
        type=COUNT,
        default=None,
        help="fixed draft depth scored (default: the export's max)",
    )
    c.add_argument("--temperature", type=TEMPERATURE, default=0.0)
    c.add_argument("--bins", type=COUNT, default=10)
    c.add_argument("--dtype", default="fp32", type=served_dtype)
    c.add_argument("--seed", type=SEED, default=0)
    add_trust_flag(c)


def _rollouts_arguments(p: argparse.ArgumentParser) -> None:
    from draftsmith.datagen.rollouts_command import add_arguments

    add_arguments(p)


def _diffusion_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="<run dir>/export (or the run folder)")
    p.add_argument("--out", required=True, help="output HF folder (written atomically)")


def _trajectories_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        required=True,
        help="block-diffusion target folder (recipe=diffusion_adapt's <run dir>/export)",
    )
    p.add_argument(
        "--prompts", default="mtbench", help="mtbench | humaneval | sharegpt | a .txt/.jsonl file"
    )
    p.add_argument("--limit", type=COUNT, default=None, help="first N prompts")
    p.add_argument("--gen-length", type=COUNT, default=256)
    p.add_argument(
        "--steps-per-block",
        type=COUNT,
        default=None,
        help="default: the block length (1 token/step)",
    )
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--threads", type=COUNT, default=None, help="torch CPU threads")
    add_trust_flag(p)
    p.add_argument("--out", required=True, help="trajectory folder (resumable)")
    p.add_argument("--shard-size", type=COUNT, default=8, help="prompts per safetensors shard")
    p.add_argument(
        "--full",
        action="store_true",
        help=(
            "decode all gen-length slots (default: stop after "
            "the block holding the reference's EoT)"
        ),
    )


def cmd_regenerate(args: argparse.Namespace) -> int:
    """Regenerate the dataset's assistant turns and print the summary."""
    from draftsmith.datagen.regenerate import regenerate, summary

    refuse_bad_exports(args)  # a --target that is an export, or ships code that would run
    report = regenerate(
        args.data,
        args.out,
        target=args.target,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        turns=args.turns,
        dtype=args.dtype,
        seed=args.seed,
        kernels=args.kernels,
        batch_size=args.batch_size,
        topic=args.topic,
        skip=args.skip,
        max_prompt_tokens=args.max_prompt_tokens,
        overwrite=args.overwrite,
        trust_remote_code=args.trust_remote_code,
    )
    print(summary(report, args.out))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Score the acceptance head's predictions against what the target accepted; write JSON and the
    PNG."""
    from draftsmith.evals.calibrate import calibrate

    refuse_bad_exports(args)
    prompts = args.prompts if Path(args.prompts).exists() else None
    check_out_folder(
        "calibrate", args.out, (args.drafter, target_of(args), prompts)
    )  # before the decoding
    result = calibrate(
        args.drafter,
        args.prompts,
        args.out,
        target=args.target,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        depth=args.depth,
        temperature=args.temperature,
        bins=args.bins,
        dtype=args.dtype,
        seed=args.seed,
    )
    print(
        f"expected calibration error {result['ece']:.4f} over {result['count']} drafts; wrote "
        f"{args.out}/calibration.json and reliability.png"
    )
    return 0


def cmd_rollouts(args: argparse.Namespace) -> int:
    """Write (or resume) an LPO rollout folder and print its summary."""
    from draftsmith.datagen.rollouts_command import check_arguments
    from draftsmith.datagen.rollouts_command import cmd_rollouts as run

    check_arguments(args)
    refuse_bad_exports(args)
    prompts = args.prompts if Path(args.prompts).exists() else None
    check_out_folder("rollouts", args.out, (target_of(args), args.controller, prompts))
    return run(args)


def cmd_diffusion_export(args: argparse.Namespace) -> int:
    """A recipe=diffusion_adapt export (or run folder) -> an ordinary HF model folder that
    ``--target`` can name."""
    from draftsmith.common.atomic_folder import check_folder_target
    from draftsmith.export.format import EXPORT_OUTPUT
    from draftsmith.runtime.target.diffusion_lm import folder_from_export

    check_folder_target(
        args.out, EXPORT_OUTPUT, sources=(args.source,)
    )  # before the model is rebuilt
    print(f"wrote {folder_from_export(args.source, args.out)}")
    return 0


def cmd_trajectories(args: argparse.Namespace) -> int:
    from draftsmith.common.prompt_sets import check_spec
    from draftsmith.datagen.trajectories import run_cli

    check_spec(args.prompts)  # before the target loads
    refuse_bad_exports(args)
    prompts = args.prompts if Path(args.prompts).exists() else None
    check_out_folder("trajectories", args.out, (args.target, prompts))
    print(json.dumps(run_cli(args), indent=2))
    return 0


ARGUMENTS = {
    "regenerate": _regenerate_arguments,
    "rollouts": _rollouts_arguments,
    "calibrate": _calibrate_arguments,
    "diffusion-export": _diffusion_export_arguments,
    "trajectories": _trajectories_arguments,
}
HANDLERS = {
    "regenerate": cmd_regenerate,
    "rollouts": cmd_rollouts,
    "calibrate": cmd_calibrate,
    "diffusion-export": cmd_diffusion_export,
    "trajectories": cmd_trajectories,
}


def _regenerate_kept(args: argparse.Namespace) -> str:
    """What an interrupted ``regenerate`` kept: the complete lines of ``OUT.partial`` (the same
    command resumes)."""
    partial = Path(f"{args.out}.partial")
    if not partial.is_file():
        return "nothing was written yet"
    lines = sum(
        1 for line in partial.read_bytes().splitlines(keepends=True) if line.endswith(b"\n")
    )
    return (
        f"kept {lines} complete conversations in {partial} (the same command resumes after the last"
        " one)"
    )


def _folder_kept(args: argparse.Namespace) -> str:
    """What an interrupted resumable folder writer kept (``rollouts``, ``trajectories``)."""
    out = Path(args.out)
    return (
        f"kept what was finished in {out} (the same command resumes there)"
        if out.exists()
        else "nothing was written yet"
    )


# command -> what a Ctrl-C kept, for the one line :func:`draftsmith.cli.main` prints
KEPT = {
    "regenerate": _regenerate_kept,
    "rollouts": _folder_kept,
    "trajectories": _folder_kept,
    "calibrate": lambda args: f"nothing was written to {args.out} (it is written at the end)",
}
