"""``draftsmith curve --out DIR [--steps N --first-steps M --points P ...] recipe=NAME
[overrides]``: a learning
curve (:mod:`draftsmith.evals.curve_runner`): held-out acceptance against training tokens and
CPU-hours, with a fit that says how many tokens a target acceptance would take. Re-running the same
command resumes it."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draftsmith.cli.arguments import COUNT, OneLineParser, served_dtype
from draftsmith.common.errors import ConfigError, DraftsmithError, InputError, report_failure

EPILOG = """example (EAGLE-3 on regenerated data, 6 points from 100 to 3,000 steps, each with a
cooldown branch):
  draftsmith curve --out outputs/curve/eagle3 --first-steps 100 --steps 3000 --points 6 \\
      recipe=eagle3 data=regen.jsonl data.limit=null
  # the forecast against a finished run:
  draftsmith curve --out outputs/curve/eagle3 --check outputs/eagle3/cosine_run
Writes DIR/curve.json, DIR/curve.md and DIR/curve.png; Ctrl-C keeps every finished point, branch
and the training checkpoints, and the same command resumes."""


def parser() -> argparse.ArgumentParser:
    """The curve's own flags; everything else on the line is a Hydra override for the training
    run."""
    p = OneLineParser(
        prog="draftsmith curve",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out", required=True, help="curve folder (a re-run with the same arguments resumes there)"
    )
    _plan_flags(p)
    _evaluation_flags(p)
    p.add_argument(
        "--cooldown",
        type=float,
        default=0.2,
        metavar="FRACTION",
        help=(
            "at each point, branch a cooldown (LR linearly to 0) over this share of the steps so"
            " far and report its acceptance beside the raw one; the fit and --compare read the"
            " cooled values (0 = no branches; default 0.2)"
        ),
    )
    _no_training_flags(p)
    return p


def _plan_flags(p: argparse.ArgumentParser) -> None:
    """Where the points fall: the whole run's steps, the first point's, and how many points."""
    p.add_argument(
        "--steps", type=COUNT, default=2000, help="last point: optimizer steps of the whole run"
    )
    p.add_argument("--first-steps", type=COUNT, default=50, help="first point's steps")
    p.add_argument(
        "--points",
        type=COUNT,
        default=6,
        help="points, log-spaced between --first-steps and --steps",
    )


def _evaluation_flags(p: argparse.ArgumentParser) -> None:
    """How each point is evaluated: held-out prompt sets, their size, new tokens, dtype, target."""
    p.add_argument(
        "--prompts",
        default="mtbench,humaneval",
        help=(
            "held-out prompt sets, comma-separated (each "
            "mtbench, humaneval or a .jsonl, with an optional [a:b] slice)"
        ),
    )
    p.add_argument("--num-prompts", type=COUNT, default=8, help="prompts of each set")
    p.add_argument("--max-new-tokens", type=COUNT, default=128, help="new tokens per prompt")
    p.add_argument(
        "--dtype",
        default="auto",
        type=served_dtype,
        help="runtime dtype of the evaluation (auto | fp32 | bf16)",
    )
    p.add_argument(
        "--target", default=None, help="target folder to serve with (default: the export's)"
    )


def _no_training_flags(p: argparse.ArgumentParser) -> None:
    """The modes that train nothing: check a finished run, re-report, compare curves."""
    p.add_argument(
        "--check",
        default=None,
        metavar="RUN_DIR",
        help=(
            "no training: evaluate a finished run (more tokens than any point) and say whether the "
            "curve's forecast interval at its tokens contains what it measures"
        ),
    )
    p.add_argument(
        "--report-only", action="store_true", help="rewrite curve.md / curve.png from curve.json"
    )
    p.add_argument(
        "--compare",
        default=None,
        metavar="DIR1,DIR2,...",
        help=(
            "no training: put these curves side by side at equal CPU-hours into --out "
            "(compare.json, compare.md, compare.png)"
        ),
    )


def _check(opts: argparse.Namespace, overrides: Sequence[str]) -> None:
    """Refuse, before any training segment: a --first-steps past --steps, a prompt set that names
    nothing, training overrides the config refuses (a misspelt key, a value out of range; not for
    --check, which trains nothing), an --out the write rule refuses (a file, a folder of the user's,
    a read-only place)."""
    from draftsmith.cli.preflight import check_out_folder
    from draftsmith.cli.train_command_line import expand_shorthands, preflight
    from draftsmith.evals.curve_runner import check_prompt_sets
    from draftsmith.evals.curve_training import training_overrides

    if opts.first_steps > opts.steps:
        raise InputError(
            f"--first-steps {opts.first_steps} is past --steps {opts.steps}: the first point comes "
            "before the last"
        )
    if not opts.compare and not opts.report_only:
        sets = [s for s in opts.prompts.split(",") if s.strip()]
        if not sets:
            raise InputError(
                "--prompts names no prompt set: give mtbench, humaneval or a .jsonl"
                " (comma-separated)"
            )
        check_prompt_sets(sets)  # the line run_curve would give, before anything trains
    # --check trains nothing: no recipe to check
    if not opts.compare and not opts.report_only and not opts.check:
        if (
            problem := preflight(expand_shorthands(training_overrides(list(overrides))))
        ) is not None:
            raise ConfigError(
                problem
            )  # one line here, not the training segment's line and then the curve's
    check_out_folder("curve", opts.out, (opts.target,))


def cmd_curve(argv: Sequence[str]) -> int:
    """Run, resume or re-report a learning curve; one ``error:`` line for bad input, 130 on
    Ctrl-C."""
    from draftsmith.evals.curve_folder import CURVE_FILE

    try:
        opts, overrides = parser().parse_known_args(list(argv))
    except SystemExit as done:  # --help, or a flag refused in one line
        return int(done.code or 0)
    out = Path(opts.out)
    try:
        _check(opts, overrides)
        if opts.compare:
            return _compare(opts.compare, out)
        if opts.check:
            return _check_forecast(opts.check, out)
        block = _run_or_report(opts, overrides, out)
    except KeyboardInterrupt:
        print(
            f"draftsmith curve: interrupted; finished points are kept in {out / CURVE_FILE},"
            f" training in {out / 'run'} and cooldown branches in {out / 'branches'}; re-run the"
            " same command to resume",
            file=sys.stderr,
        )
        return 130
    except DraftsmithError as err:  # anything else is a bug: its traceback (draftsmith.cli.main)
        return report_failure(err, "draftsmith curve", user_exit=1)
    print(json.dumps(block, indent=1))
    print(f"wrote {out / CURVE_FILE}, {out / 'curve.md'}, {out / 'curve.png'}")
    return 0


def _compare(folders: str, out: Path) -> int:
    """``--compare DIR1,DIR2,...``: the curves side by side at equal CPU-hours, written into
    ``out``."""
    from draftsmith.evals.curve_compare import compare
    from draftsmith.evals.curve_folder import CURVE_FILE, CurveError

    dirs = [d for d in folders.split(",") if d]
    missing = [d for d in dirs if not (Path(d) / CURVE_FILE).is_file()]
    if missing:
        raise CurveError(f"not a curve folder (no {CURVE_FILE}): {', '.join(missing)}")
    print(json.dumps(compare(dirs, out)))
    print(f"wrote {out / 'compare.json'}, {out / 'compare.md'}, {out / 'compare.png'}")
    return 0


def _check_forecast(run_dir: str, out: Path) -> int:
    """``--check RUN_DIR``: whether the curve's forecast interval holds what the finished run
    measures."""
    from draftsmith.evals.curve_check import run_check

    record = run_check(out, run_dir)
    print(json.dumps(record, indent=1))
    verdict = {
        True: "inside its interval",
        False: "OUTSIDE its interval",
        None: "not decided (no fit)",
    }
    print(f"forecast check of {run_dir}: {verdict[record['all_inside']]}; wrote {out / 'curve.md'}")
    return 0


def _run_or_report(opts: argparse.Namespace, overrides: Sequence[str], out: Path) -> dict[str, Any]:
    """Run (or resume) the curve's points, or with ``--report-only`` re-report curve.json; returns
    the report's block."""
    from draftsmith.evals.curve_folder import CURVE_FILE, CurveError
    from draftsmith.evals.curve_report import write_report
    from draftsmith.evals.curve_runner import log_spaced_steps, run_curve
    from draftsmith.evals.learning_curve import EvalSettings

    if opts.report_only:
        if not (out / CURVE_FILE).is_file():
            raise CurveError(f"{out / CURVE_FILE} not found: run the curve first")
        return write_report(out, json.loads((out / CURVE_FILE).read_text()))
    settings = EvalSettings(
        tuple(s for s in opts.prompts.split(",") if s),
        opts.num_prompts,
        opts.max_new_tokens,
        opts.dtype,
        opts.target,
    )
    plan = log_spaced_steps(opts.first_steps, opts.steps, opts.points)
    curve = run_curve(out, overrides, plan, settings, cooldown=opts.cooldown)
    return write_report(out, curve.data)


RAW_HANDLERS = {"curve": cmd_curve}
