"""The ``draftsmith rollouts`` command line (also ``python -m
draftsmith.datagen.rollouts_command``): its flags and their checks, the warning about prompts
longer than training will read, loading the target and the controller, and the run that
:mod:`draftsmith.datagen.rollouts` writes."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from draftsmith.controllers.adaptive_temperature import (
    DEFAULT_GRID,
    AdaptiveTemperatureHead,
    check_granularity,
    check_grid,
)
from draftsmith.datagen import rollouts
from draftsmith.datagen.rewards import load_reward
from draftsmith.datagen.rollout_sampling import eos_ids_of
from draftsmith.datagen.rollouts import RolloutError, settings, write_rollouts

# conf/data/sharegpt.yaml's data.max_length, what `train.py recipe=adaptive_temperature
# data=<rollouts>` cuts rows at unless told otherwise (datagen/ reads no Hydra config;
# tests/test_training_refusals.py keeps the two equal).
DEFAULT_TRAIN_MAX_LENGTH = 256


def length_warning(
    prompt_lengths: Sequence[int],
    max_new_tokens: int,
    train_max_length: int = DEFAULT_TRAIN_MAX_LENGTH,
) -> str | None:
    """The warning to print before sampling when prompts will not fit training's default
    ``data.max_length``: prompts that leave no response token are skipped by training, longer
    responses are cut; None when all fit.
    """
    if not prompt_lengths:
        return None
    longest = max(prompt_lengths)
    too_long = sum(n >= train_max_length for n in prompt_lengths)
    cut = sum(n < train_max_length < n + max_new_tokens for n in prompt_lengths)
    if not too_long and not cut:
        return None
    parts = []
    if too_long:
        parts.append(
            f"{too_long} of {len(prompt_lengths)} prompt(s) have {train_max_length}+ tokens (the"
            f" longest {longest}) and leave no response token at training's default"
            f" data.max_length={train_max_length}: training skips them"
        )
    if cut:
        parts.append(
            f"{cut} prompt(s) + --max-new-tokens {max_new_tokens} exceed it: their responses"
            " are cut"
        )
    return (
        f"warning: {'; '.join(parts)}. Train with data.max_length={longest + max_new_tokens}, or"
        " use shorter prompts (--limit / --prompts)"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``rollouts`` subcommand's flags."""
    p.add_argument(
        "--target",
        default="smollm2-135m",
        help="target folder (default: the embedded smollm2-135m)",
    )
    p.add_argument(
        "--prompts",
        default="embedded",
        help="embedded[:train|heldout|all] or a .jsonl of {text, kind?, answer?}",
    )
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument(
        "--reward",
        default="embedded",
        help=(
            "embedded (exact match where a prompt has an answer, else relevance - repetition),"
            " exact_match, open_ended, or an import path pkg.module:function"
        ),
    )
    p.add_argument(
        "--controller",
        default=None,
        help=(
            "adaptive-temperature export to sample with (default: uniform "
            "random grid temperatures, the first round)"
        ),
    )
    p.add_argument(
        "--grid",
        default=None,
        help="comma-separated temperatures (default 0,0.2,...,1; with --controller: the export's)",
    )
    p.add_argument(
        "--granularity",
        default=None,
        help="sequence | token (default token; with --controller: the export's)",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="fp32", help="fp32 | bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (1 is much faster on a busy machine)",
    )
    p.add_argument("--out", required=True, help="rollout folder (resumes a partial one)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let a target folder that ships its own Python code (config.json auto_map) run it",
    )


def check_arguments(args: argparse.Namespace) -> tuple[tuple[float, ...], str]:
    """Refuse out-of-range flags in one line naming the flag (before the target loads); returns the
    checked grid and granularity."""
    for flag, value, low in (
        ("--limit", args.limit, 1),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--threads", args.threads, 1),
        ("--seed", args.seed, 0),
        ("--samples-per-prompt", args.samples_per_prompt, 2),
    ):
        if value is not None and value < low:
            why = " to form a chosen/rejected pair" if flag == "--samples-per-prompt" else ""
            raise RolloutError(f"{flag} must be >= {low}{why}, got {value}")
    if args.dtype not in ("fp32", "bf16"):
        raise RolloutError(f"--dtype {args.dtype!r}: rollouts run fp32 or bf16")
    try:
        grid = check_grid(
            [t for t in args.grid.split(",") if t.strip()]
            if args.grid is not None
            else DEFAULT_GRID
        )
    except ValueError as err:
        raise RolloutError(f"--grid {args.grid}: {err}") from None
    try:
        return grid, check_granularity(args.granularity or "token")
    except ValueError as err:
        raise RolloutError(f"--granularity {args.granularity}: {err}") from None


def cmd_rollouts(args: argparse.Namespace) -> int:
    """Run ``draftsmith rollouts`` and print its summary as JSON."""
    grid, granularity = check_arguments(args)
    head = None
    if args.controller:
        head = _controller(args, grid, granularity)
        grid, granularity = tuple(head.config.grid), head.config.granularity
    reward = load_reward(args.reward)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer, model = _load_target(args)
    if head is not None and head.config.hidden_size != model.config.hidden_size:
        raise RolloutError(
            f"the controller reads hidden size {head.config.hidden_size} but the target has "
            f"{model.config.hidden_size}; use the target it was trained on"
        )
    records = _encoded_prompts(args, tokenizer)
    meta = settings(
        args.target,
        grid,
        granularity,
        args.samples_per_prompt,
        args.max_new_tokens,
        args.reward,
        args.seed,
        args.prompts,
        len(records),
        str(Path(args.controller).resolve()) if args.controller else None,
    )
    summary = write_rollouts(
        model,
        records,
        args.out,
        reward,
        lambda t: tokenizer.decode(t, skip_special_tokens=True),
        meta,
        head,
        eos_ids_of(tokenizer, model),
        progress=not args.no_progress,
    )
    print(json.dumps(summary, indent=2))
    return 0


def _controller(
    args: argparse.Namespace, grid: tuple[float, ...], granularity: str
) -> AdaptiveTemperatureHead:
    """The ``--controller`` export's head; a ``--grid`` or ``--granularity`` given that differs
    from the export's is refused."""
    head, _ = AdaptiveTemperatureHead.from_export(args.controller)
    for flag, mine, theirs in (
        ("--grid", grid, tuple(head.config.grid)),
        ("--granularity", granularity, head.config.granularity),
    ):
        given = args.grid if flag == "--grid" else args.granularity
        if given is not None and mine != theirs:
            raise RolloutError(
                f"{flag} {given} differs from the controller's {theirs}; drop the flag"
            )
    return head


def _load_target(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(tokenizer, model)`` of ``--target`` in ``--dtype``, its own code run only when trusted."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith import assets
    from draftsmith.common.remote_code import refuse_remote_code

    path = assets.resolve_target(args.target)
    trust = bool(getattr(args, "trust_remote_code", False))
    refuse_remote_code(path, trust)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust).eval()
    return tokenizer, model


def _encoded_prompts(args: argparse.Namespace, tokenizer: Any) -> list[dict]:
    """The ``--prompts`` records with their chat-encoded ``ids``; warns, before the long part (not
    at training's step 0), when they will not fit training's default ``data.max_length``."""
    from draftsmith.common.chat import encode_chat
    from draftsmith.datagen.mixed_task import load_prompt_records

    records = load_prompt_records(args.prompts, args.limit)
    for r in records:
        r["ids"] = encode_chat(tokenizer, r["text"])
    warning = length_warning([len(r["ids"]) for r in records], args.max_new_tokens)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    return records


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m draftsmith.datagen.rollouts_command ...`` (the same flags as ``draftsmith
    rollouts``)."""
    description = rollouts.__doc__.split("\n")[0]
    parser = argparse.ArgumentParser(prog="draftsmith rollouts", description=description)
    add_arguments(parser)
    return cmd_rollouts(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
