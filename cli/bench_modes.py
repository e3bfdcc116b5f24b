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

from draftsmith.cli import bench_flags
from draftsmith.cli.preflight import (
    check_new_tokens_fit,
    check_out_folder,
    refuse_bad_exports,
    target_of,
)
from draftsmith.cli.serving import _is_diffusion_target, _llamacpp_parity, runtime_from_flags
from draftsmith.common.errors import InputError


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

    # the bench parser alone: argparse hands it the words after `bench`
    b.parse_known_args = with_mode


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

    with progress.current().phase("load target, export and prompts"):
        rt = runtime_from_flags(args)
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
        bench_flags.export_arguments,
        _run_export,
    ),
    "controller": Mode(
        "an adaptive-temperature layer's overhead in tokens/s",
        bench_flags.controller_arguments,
        _run_controller,
    ),
    "reward": Mode(
        "rewards of fixed temperatures and adaptive-temperature layers on a reward task",
        bench_flags.reward_arguments,
        _run_reward,
    ),
    "diffusion": Mode(
        "the Learn2PD filter on a block-diffusion target",
        bench_flags.diffusion_arguments,
        _run_diffusion,
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
