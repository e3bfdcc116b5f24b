"""The ``draftsmith`` command. Every command is one row of :data:`COMMANDS`; its arguments and
handler live in the module the row names (``training``, ``exporting``, ``serving``, ``data``,
``engines``...), imported only when the command line is parsed. Failures follow
:func:`draftsmith.common.errors.report_failure` (:data:`ERRORS_HELP`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from draftsmith.common.errors import TRACEBACK_ENV, report_failure

# name -> (module in draftsmith.cli, help). Commands in RAW_ARGV take Hydra overrides and parse
# their own argv.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("training", "train a drafter: draftsmith train recipe=medusa [hydra overrides]"),
    "bench-train": (
        "training",
        "training tokens/s vs target forward tokens/s: draftsmith bench-train recipe=medusa",
    ),
    "cache-features": (
        "training",
        (
            "run the target once and cache the features a recipe taps: "
            "draftsmith cache-features recipe=eagle3 --out DIR"
        ),
    ),
    "export": (
        "exporting",
        "export a run folder or checkpoint (or convert an export to an engine's layout)",
    ),
    "import": (
        "importing",
        "import a speculators-format EAGLE-3 checkpoint: draftsmith import CKPT --out DIR",
    ),
    "assets": ("training", "prepare the embedded target, data and prompts; print their counts"),
    "generate": (
        "serving",
        "stream a completion (speculative with --drafter, else autoregressive)",
    ),
    "bench": (
        "bench_modes",
        (
            "bench MODE: export (tau, acceptance, tokens/s and lossless check of an export; the "
            "default), controller, reward or diffusion; bench MODE --help lists its flags"
        ),
    ),
    "regenerate": (
        "data",
        (
            "rewrite a chat dataset's assistant turns with the target (self-distilled data for "
            "data.spec=)"
        ),
    ),
    "rollouts": (
        "data",
        (
            "sample N responses per prompt with the adaptive-temperature decoder, score them, write"
            " chosen/rejected pairs (data for recipe=adaptive_temperature)"
        ),
    ),
    "trajectories": ("data", "Learn2PD oracle trajectories of a diffusion target"),
    "diffusion-export": ("data", "turn a recipe=diffusion_adapt export into a HF model folder"),
    "engine-check": (
        "engines",
        (
            "run an EAGLE-3 export in llama.cpp (plain and speculative, greedy): lossless in the "
            "engine, its acceptance and tokens/s beside the runtime's"
        ),
    ),
    "calibrate": (
        "data",
        (
            "reliability plot + expected calibration error of a SpecDec++ acceptance head on "
            "held-out drafts"
        ),
    ),
    "curve": (
        "curve",
        (
            "learning curve: train in segments, held-out acceptance against training tokens and "
            "CPU-hours, with a fit: draftsmith curve --out DIR recipe=eagle3 [overrides]"
        ),
    ),
    "method-table": (
        "method_table",
        (
            "equal-budget method table: train each recipe for the same steps on the same batches, "
            "bench each export, write table.json/md/png (resumable)"
        ),
    ),
    "flagship": (
        "flagship",
        (
            "the drafter kept in the repository: ship RUN (replaces it when held-out acceptance "
            "gains 0.02), train (a sitting of make train-best), show, table"
        ),
    ),
}
RAW_ARGV = ("train", "bench-train", "cache-features", "curve")
DESCRIPTION = (
    "Train, export, serve and measure learned speculative-decoding drafters (draftsmith COMMAND"
    " --help)."
)
ERRORS_HELP = (
    "errors: a mistake in the input is one 'error:' line (exit 2); add --traceback anywhere on the"
    " command line (or set DRAFTSMITH_TRACEBACK=1) to see its traceback. Anything else is a bug in"
    " draftsmith: its traceback, then a line saying where to report it (exit 1). Ctrl-C: one line"
    " saying what was kept (exit 130)."
)


def command_module(name: str):
    """The module that holds command ``name``'s arguments (``ARGUMENTS``) and handler
    (``HANDLERS``/``RAW_HANDLERS``)."""
    return importlib.import_module(f"draftsmith.cli.{COMMANDS[name][0]}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of :data:`COMMANDS`. With ``command``, only that command's arguments are
    added (the others keep their name and help), so a command line imports its own module alone.
    Refusals are one line (:class:`~draftsmith.cli.arguments.OneLineParser`): a value out of its
    declared range names the flag.
    """
    from draftsmith.cli.arguments import OneLineParser

    parser = OneLineParser(prog="draftsmith", description=DESCRIPTION, epilog=ERRORS_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, helptext) in COMMANDS.items():
        p = sub.add_parser(name, help=helptext)
        if command not in (None, name):
            continue
        add_arguments = getattr(command_module(name), "ARGUMENTS", {}).get(name)
        if add_arguments is not None:
            add_arguments(p)
    return parser


def interrupted_line(command: str, argv: Sequence[str], args: argparse.Namespace | None) -> str:
    """The one line a Ctrl-C prints: what the command kept (its module's ``KEPT[command](args)``,
    else that nothing was written) and the command line that resumes (or reruns) it."""
    import shlex

    kept = None
    if args is not None and command in COMMANDS:
        describe = getattr(command_module(command), "KEPT", {}).get(command)
        try:
            kept = describe(args) if describe is not None else None
        except (
            OSError,
            AttributeError,
            ValueError,
        ):  # the line must come out even if what was kept cannot be read
            kept = None
    rerun = "draftsmith " + shlex.join(argv)
    return (
        f"draftsmith {command}: interrupted (Ctrl-C): {kept or 'nothing was written'}; "
        f"{'resume' if kept and 'resum' in kept else 'rerun'} with: {rerun}"
    )


@contextmanager
def _traceback_flag(argv: list[str]) -> Iterator[list[str]]:
    """``--traceback`` (anywhere before a lone ``--``) turns tracebacks on for this run, through the
    environment so its subprocesses see it too, and back off after it (an in-process caller's later
    runs are its own); yields the arguments without the flag."""
    if "--traceback" not in argv:
        yield argv
        return
    name = TRACEBACK_ENV[0]
    before = os.environ.get(name)
    os.environ[name] = "1"
    try:
        yield [a for a in argv if a != "--traceback"]
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``draftsmith`` console script: exit 0; 2 with one ``error:`` line for an
    error draftsmith raised on purpose (:class:`~draftsmith.common.errors.DraftsmithError`); 130
    with one line saying what was kept and how to resume on Ctrl-C; anything else is a bug: its
    traceback and a line saying so (exit 1).
    """
    with _traceback_flag(list(sys.argv[1:] if argv is None else argv)) as args:
        return _run(args)


def _run(argv: list[str]) -> int:
    """One command line, its failures reported as :func:`main` says."""
    command, args = (argv[0] if argv else "draftsmith"), None
    try:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        if argv and argv[0] in RAW_ARGV:  # everything after the name is Hydra's
            return command_module(argv[0]).RAW_HANDLERS[argv[0]](argv[1:])
        try:
            args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
        except SystemExit as done:  # --help (0) or a refusal already printed as one line (2)
            return int(done.code or 0)
        return command_module(args.command).HANDLERS[args.command](args)
    except KeyboardInterrupt:
        print(interrupted_line(command, argv, args), file=sys.stderr)
        return 130
    # the one policy: a purposeful error is one line, a bug its traceback
    except Exception as err:  # noqa: BLE001
        return report_failure(err, f"draftsmith {command}" if command in COMMANDS else "draftsmith")
