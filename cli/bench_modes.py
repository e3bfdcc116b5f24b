"""``draftsmith bench MODE``: one explicit mode per kind of bench, each with only its own flags
(``bench MODE --help``).

* ``export`` (the default): an export's speed, tau, lossless check, and optionally llama.cpp, engine
  parity, an oracle beside it (or alone on the target without ``--drafter``);
* ``controller``: an adaptive-temperature layer's overhead in tokens/s;
* ``reward``: rewards of fixed temperatures and adaptive-temperature layers on a reward task;
* ``diffusion``: the Learn2PD filter on a block-diffusion target.

A command line without a mode word still runs (scripts and docs written before the modes): the mode
is read off its flags once, here (:func:`legacy_mode`), and a note names the mode so the next line
can say it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.cli.arguments import COUNT, SEED, TEMPERATURE, Range, counts, number_list
from draftsmith.cli.oracle_flags import add_oracle_arguments
from draftsmith.cli.preflight import (
    check_new_tokens_fit,
    check_out_folder,
    refuse_bad_exports,
    target_of,
)
from draftsmith.cli.serving import (
    _is_diffusion_target,
    _llamacpp_parity,
    add_serving_flags,
    add_target_flags,
)
from draftsmith.cli.serving import add_verifier_flag as _add_verifier
from draftsmith.common.errors import InputError


def _prompts_and_out(b: argparse.ArgumentParser, prompts: str = "mtbench", also: str = "") -> None:
    b.add_argument(
        "--prompts",
        default=prompts,
        help=(
            "mtbench, humaneval or a .jsonl with 'prompt' (or 'turns'); NAME[a:b] takes a"
            f" slice{also}"
        ),
    )
    b.add_argument(
        "--num-prompts",
        type=counts("leave it out to use every prompt"),
        default=None,
        help="use the first N prompts",
    )
    b.add_argument(
        "--out", default=None, help="folder for the results (checked before the bench runs)"
    )


def _export_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--drafter", default=None, help="export folder of a trained drafter")
    _prompts_and_out(b)
    b.add_argument("--seed", type=SEED, default=0)
    b.add_argument("--skip-hf", action="store_true", help="do not time HF generate")
    b.add_argument(
        "--profile",
        action="store_true",
        help=(
            "time each part of a speculative step (drafting, verify forward, verification, KV,"
            " update)"
        ),
    )
    b.add_argument(
        "--sweep-k",
        default=None,
        type=number_list(Range(int, low=0), "draft depths"),
        metavar="K1,K2,...",
        help="also time fixed draft depths K on the same prompts, next to the policy in force",
    )
    b.add_argument(
        "--hf-dtype",
        default="auto",
        choices=["auto", "same", "fp32", "bf16"],
        help=(
            "dtype HF generate is timed in: auto (its fastest here: bf16 where native, else fp32) |"
            " same (the runtime's) | fp32 | bf16"
        ),
    )
    b.add_argument(
        "--lossless-dtype",
        default="fp32",
        choices=["fp32", "bf16", "same", "none"],
        help=(
            "dtype of the lossless check (greedy spec vs HF generate); 'same' = the timing dtype, "
            "'none' = skip"
        ),
    )
    b.add_argument(
        "--llamacpp",
        action="store_true",
        help=(
            "also time llama.cpp greedy on the same prompts and threads (`make llamacpp` builds it"
            " once): the shipped Q4_1 GGUF and a BF16 GGUF converted from the target"
            " (peers.llamacpp)"
        ),
    )
    b.add_argument(
        "--window",
        type=COUNT,
        default=None,
        metavar="TOKENS",
        help=(
            "output tokens per window of tau by output window (bench.json tau_by_window; default"
            " 256)"
        ),
    )
    b.add_argument(
        "--long",
        action="store_true",
        help=(
            "long outputs, so acceptance decay shows: 2 prompts x 2048 "
            "new tokens, window 256 (each where not given); generation still stops at EOS"
        ),
    )
    b.add_argument(
        "--engine-parity",
        action="store_true",
        help=(
            "also run the export in each engine in reach that runs its method (llama.cpp: EAGLE-3,"
            " DFlash) on the same prompts and drafted chain: tau ours vs tau in the engine; a gap"
            " over 5%% is a defect of the export (bench.json engine_parity)"
        ),
    )
    b.add_argument(
        "--parity-chain",
        type=COUNT,
        default=None,
        help=(
            "with --engine-parity: tokens drafted per step in both engines (default: 4; DFlash: "
            "block_size - 1)"
        ),
    )
    add_oracle_arguments(b)
    add_serving_flags(b)
    b.set_defaults(max_new_tokens=None)  # 128, or --long's 2048 (bench.windows.apply_preset)


def _controller_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument(
        "--controller",
        required=True,
        help="adaptive-temperature export: tokens/s with and without it",
    )
    b.add_argument(
        "--drafter",
        default=None,
        help="with a drafter: speculative sampling against the tempered target",
    )
    _prompts_and_out(b)
    add_serving_flags(b)


def _reward_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument(
        "--controller",
        default=None,
        help=(
            "adaptive-temperature export(s), comma-separated (none: fixed temperatures only): the"
            " mean reward of each layer and of every fixed temperature of its grid, per prompt"
            " kind, with 95%% intervals, and each layer's overhead in tokens/s"
        ),
    )
    _prompts_and_out(
        b,
        "embedded:heldout",
        "; also embedded[:train|heldout|all] (the mixed reward task) or a .jsonl "
        "of {text, kind?, answer?}",
    )
    b.add_argument(
        "--reward",
        default=None,
        help=(
            "score rewards with this reward (embedded, exact_match, open_ended "
            "or pkg.module:function; default embedded on the embedded task)"
        ),
    )
    b.add_argument(
        "--samples-per-prompt", type=COUNT, default=4, help="responses sampled per prompt"
    )
    b.add_argument(
        "--grid",
        default=None,
        type=number_list(TEMPERATURE, "temperatures"),
        help="the fixed temperatures compared (default: the controllers' grid, else 0,0.2,...,1)",
    )
    b.add_argument(
        "--overhead-prompts", type=COUNT, default=8, help="prompts timed for the overhead"
    )
    b.add_argument("--seed", type=SEED, default=0)
    add_target_flags(b)
    _add_verifier(b)


def _diffusion_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument(
        "--target",
        required=True,
        help=(
            "block-diffusion target (recipe=diffusion_adapt's <run dir>/export "
            "or `draftsmith diffusion-export`'s folder)"
        ),
    )
    b.add_argument(
        "--filter", default=None, help="Learn2PD export: bench baseline, Learn2PD, EoTP and both"
    )
    _prompts_and_out(b)
    b.add_argument(
        "--cache",
        default="off",
        choices=["off", "on", "both"],
        help="prefix KV cache across finished blocks off, on, or every mode both ways",
    )
    b.add_argument("--gen-length", type=COUNT, default=256, help="answer slots per prompt")
    b.add_argument(
        "--steps-per-block",
        type=counts("leave it out for one step per block position"),
        default=None,
        help="denoising steps per block (default: the block length)",
    )
    b.add_argument(
        "--threshold",
        default=None,
        type=Range(
            float,
            low=0,
            high=1,
            low_open=True,
            high_open=True,
            hint=(
                "the Learn2PD filter's acceptance threshold: needs --filter EXPORT and a value"
                " strictly between 0 and 1"
            ),
        ),
        help="the Learn2PD filter's acceptance threshold (default: the exported one)",
    )
    b.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow a target whose modelling code ships with it (LLaDA, Dream)",
    )
    b.add_argument("--temperature", type=TEMPERATURE, default=0.0)
    b.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16", "auto"],
        help="fp32 (auto means fp32) | bf16",
    )


def _value(tokens: list[str], flag: str) -> str | None:
    """The value given to ``flag`` in raw ``tokens`` (``--flag V`` or ``--flag=V``), else None."""
    for i, token in enumerate(tokens):
        if token == flag and i + 1 < len(tokens):
            return tokens[i + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    return None


def legacy_mode(tokens: list[str]) -> tuple[str, str | None]:
    """The mode a bench line without a mode word ran before the modes, and which flag chose it
    (None: export)."""
    given = {t.split("=", 1)[0] for t in tokens if t.startswith("--")}
    if "--filter" in given:
        return "diffusion", "--filter"
    if _is_diffusion_target(_value(tokens, "--target")):
        return "diffusion", "a block-diffusion --target"
    if "--reward" in given or str(_value(tokens, "--prompts") or "").startswith("embedded"):
        return "reward", "--reward" if "--reward" in given else "--prompts embedded"
    if "--controller" in given:
        return "controller", "--controller"
    return "export", None


@dataclass(frozen=True)
class Mode:
    """One bench mode: its help line, its flags and what runs it."""

    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _bench_arguments(b: argparse.ArgumentParser) -> None:
    """``bench MODE [flags]``; a line without a mode word gets the one :func:`legacy_mode` reads off
    its flags."""
    b.description = __doc__.split("\n\n")[0]
    modes = b.add_subparsers(dest="bench_mode", metavar="MODE", required=True)
    parsers = {
        name: modes.add_parser(name, help=mode.help, description=mode.help)
        for name, mode in MODES.items()
    }
    for name, mode in MODES.items():
        mode.arguments(parsers[name])
    for (
        name,
        parser,
    ) in parsers.items():  # a flag of another mode is refused naming the mode that takes it
        parser.flag_homes = {
            flag: other
            for other, p in parsers.items()
            if other != name
            for flag in p._option_string_actions
            if flag not in parser._option_string_actions
        }
    parse = b.parse_known_args

    def with_mode(
        args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> Any:
        args = list(args or [])
        if not args or (args[0] not in MODES and args[0] not in ("-h", "--help")):
            mode, why = legacy_mode(args)
            namespace = namespace or argparse.Namespace()
            namespace.mode_note = why and (
                f"note: this ran `draftsmith bench {mode}` (chosen from {why}); name the "
                "mode to say so"
            )
            args = [mode, *args]
        namespace, extras = parse(args, namespace)
        if extras:  # refused by the mode's parser, which names the mode that takes a stray flag
            parsers[args[0]].error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    b.parse_known_args = (
        with_mode  # the bench parser alone: argparse hands it the words after `bench`
    )


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the bench mode the command line named (or :func:`legacy_mode` read off it)."""
    from draftsmith.bench import progress

    progress.start(
        key="|".join(str(getattr(args, k, None)) for k in ("bench_mode", "target", "drafter"))
    )
    code = MODES[args.bench_mode].run(args)
    if getattr(args, "mode_note", None):  # after the results: a tip for the next command line
        print(args.mode_note, file=sys.stderr)
    return code


def _preflight(args: argparse.Namespace) -> None:
    """After a mode's own flag checks, before anything loads: the exports and target it names, and
    ``--out`` (never into an input or a folder of the user's, never where it cannot be written:
    before the bench, not after it).
    """
    refuse_bad_exports(args)
    if getattr(args, "out", None):
        exports = ",".join(
            str(getattr(args, k, None) or "") for k in ("drafter", "controller", "filter")
        )
        prompts = args.prompts if Path(args.prompts).exists() else None
        check_out_folder("bench", args.out, (*exports.split(","), target_of(args), prompts))


def _load(args: argparse.Namespace) -> tuple[Any, list[list[int]]]:
    """The runtime and the prompts, as the phase "load" of the bench."""
    from draftsmith.bench import progress
    from draftsmith.bench.prompts import load_prompts
    from draftsmith.runtime.decoding.prompt_limits import context_limit
    from draftsmith.runtime.serving import load_runtime, parse_options

    with progress.current().phase("load target, export and prompts"):
        rt = load_runtime(
            args.drafter,
            args.target,
            args.dtype,
            args.kernels,
            args.verifier,
            args.temperature,
            proposer_options=parse_options(args.proposer_option),
            linear_backend=args.linear_backend,
            stop_policy=args.stop_policy,
            controller=getattr(args, "controller", None),
            backend=args.backend,
            trust_remote_code=args.trust_remote_code,
        )
        limit = context_limit(rt.model)
        prompts = load_prompts(args.prompts, rt.tokenizer, args.num_prompts, max_len=limit)
        longest = max(map(len, prompts))
        check_new_tokens_fit(
            longest, args.max_new_tokens, limit, f"the longest prompt of {args.prompts}"
        )
        return rt, prompts


def _run_export(args: argparse.Namespace) -> int:
    from draftsmith.bench.export_bench import bench_export
    from draftsmith.bench.oracle import bench_oracle_alone, oracle_request
    from draftsmith.bench.windows import apply_preset

    apply_preset(args)
    oracle = oracle_request(args)  # the --oracle-* flags checked together
    if args.engine_parity and not args.drafter:
        raise InputError(
            "--engine-parity compares a drafter's tau across engines: it needs --drafter EXPORT"
        )
    if not args.drafter and not oracle:
        raise InputError(
            "bench export needs --drafter EXPORT (or --oracle-acceptance P alone on the target);"
            " the other benches: draftsmith bench controller|reward|diffusion --help"
        )
    _preflight(args)
    if not args.drafter:
        return bench_oracle_alone(args, oracle)
    rt, prompts = _load(args)
    return bench_export(args, rt, prompts, _llamacpp_parity)


def _run_controller(args: argparse.Namespace) -> int:
    from draftsmith.bench.controller import bench_controller, controller_table

    if "," in args.controller:
        raise InputError(
            "several --controller exports are compared by the reward bench: draftsmith bench reward"
            " --controller A,B"
        )
    _preflight(args)
    rt, prompts = _load(args)
    result = bench_controller(rt, prompts, args.max_new_tokens)
    print(controller_table(result))
    if args.out:
        from draftsmith.common.atomic_folder import write_file

        write_file(Path(args.out) / "controller.json", json.dumps(result, indent=2) + "\n")
    return 0


def _run_reward(args: argparse.Namespace) -> int:
    from draftsmith.evals.reward_bench import cmd_reward_bench

    _preflight(args)
    return cmd_reward_bench(args)


def _run_diffusion(args: argparse.Namespace) -> int:
    """The Learn2PD filter bench (:mod:`draftsmith.evals.diffusion`)."""
    from draftsmith.evals.diffusion import run_cli

    _preflight(args)
    run_cli(
        argparse.Namespace(
            target=args.target,
            filter=args.filter,
            prompts=args.prompts,
            limit=args.num_prompts,
            gen_length=args.gen_length,
            steps_per_block=args.steps_per_block,
            threshold=args.threshold,
            cache=args.cache,
            temperature=args.temperature,
            dtype="fp32" if args.dtype == "auto" else args.dtype,
            threads=None,
            trust_remote_code=args.trust_remote_code,
            out=str(Path(args.out) / "diffusion_bench.json") if args.out else None,
        )
    )
    return 0


MODES: dict[str, Mode] = {
    "export": Mode(
        "an export's speed, tau and lossless check (the default mode)",
        _export_arguments,
        _run_export,
    ),
    "controller": Mode(
        "an adaptive-temperature layer's overhead in tokens/s",
        _controller_arguments,
        _run_controller,
    ),
    "reward": Mode(
        "rewards of fixed temperatures and adaptive-temperature layers on a reward task",
        _reward_arguments,
        _run_reward,
    ),
    "diffusion": Mode(
        "the Learn2PD filter on a block-diffusion target", _diffusion_arguments, _run_diffusion
    ),
}


def _bench_kept(args: argparse.Namespace) -> str:
    """What an interrupted ``bench`` kept: nothing (its outputs are written at the end, each file
    atomically)."""
    where = f" to {args.out}" if getattr(args, "out", None) else ""
    return (
        f"nothing was written{where} (a bench writes its results at the end; files there before are"
        " unchanged)"
    )


# command -> what a Ctrl-C kept, for the one line :func:`draftsmith.cli.main` prints
KEPT = {"bench": _bench_kept}
ARGUMENTS = {"bench": _bench_arguments}
HANDLERS = {"bench": cmd_bench}
