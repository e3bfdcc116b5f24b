"""``draftsmith flagship ACTION``: the drafter kept in the repository
(:mod:`draftsmith.evals.flagship`).

* ``ship RUN_OR_EXPORT``: measure a candidate's held-out acceptance and replace the shipped drafter
  only when its first-position acceptance rises by 0.02 or more (prints the comparison either way);
* ``train --root DIR -- OVERRIDES``: one sitting of ``make train-best``
  (:mod:`draftsmith.evals.flagship_train`): resume the unfinished run, or warm-start a new one from
  the drafter with the most tokens;
* ``show [DIR]``: the shipped drafter's record; ``table BENCH_DIR...``: benches side by side (``make
  demo``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftsmith.cli.arguments import COUNT


def _ship_arguments(p: argparse.ArgumentParser) -> None:
    from draftsmith.evals.flagship import FLAGSHIP_DIR, MIN_GAIN

    p.add_argument("candidate", help="a training run folder (its export/) or an export folder")
    p.add_argument(
        "--dest", default=str(FLAGSHIP_DIR), help="the shipped folder (default: the repository's)"
    )
    p.add_argument(
        "--min-gain",
        type=float,
        default=MIN_GAIN,
        help="mean held-out first-position acceptance the candidate must add (default 0.02)",
    )
    p.add_argument(
        "--prompts", default="mtbench,humaneval", help="held-out prompt sets, comma-separated"
    )
    p.add_argument("--num-prompts", type=COUNT, default=8)
    p.add_argument("--max-new-tokens", type=COUNT, default=128)
    p.add_argument(
        "--dtype",
        default="fp32",
        choices=("fp32", "bf16", "auto"),
        help="the evaluation's dtype (fp32: the same acceptance on every machine)",
    )
    p.add_argument(
        "--speed",
        action="store_true",
        help=(
            "when it ships, also time it served against plain decoding here (draftsmith bench) for"
            " the record"
        ),
    )
    p.add_argument(
        "--work",
        default=None,
        help=(
            "where the bf16 copy and the evaluations are kept between re-runs "
            "(default: $DRAFTSMITH_CACHE/ship)"
        ),
    )


def _train_arguments(p: argparse.ArgumentParser) -> None:
    from draftsmith.evals.flagship import FLAGSHIP_DIR

    p.add_argument("--root", required=True, help="state folder of the sittings (runs/NNN, current)")
    p.add_argument(
        "--init",
        default="auto",
        help=(
            "auto (the shipped flagship or the newest finished run here, "
            "whichever trained on more tokens) | none | an export folder"
        ),
    )
    p.add_argument(
        "--flagship", default=str(FLAGSHIP_DIR), help="the shipped folder --init auto considers"
    )
    p.add_argument(
        "overrides",
        nargs=argparse.REMAINDER,
        help="-- then train.py's overrides (trainer.max_steps=N)",
    )


def _arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", required=True)
    _ship_arguments(
        actions.add_parser("ship", help="replace the shipped drafter when a candidate gains 0.02")
    )
    _train_arguments(actions.add_parser("train", help="one sitting of make train-best"))
    show = actions.add_parser("show", help="the shipped drafter's record")
    show.add_argument("dest", nargs="?", default=None)
    table = actions.add_parser(
        "table", help="benches side by side: draftsmith bench --out DIR folders"
    )
    table.add_argument("bench_dirs", nargs="+")
    table.add_argument("--out", default=None, help="also write the table to this file")


def _ship(args: argparse.Namespace) -> int:
    from draftsmith.evals.flagship import ship
    from draftsmith.evals.flagship_record import served_speed
    from draftsmith.evals.learning_curve import EvalSettings

    settings = EvalSettings(
        tuple(s for s in args.prompts.split(",") if s),
        args.num_prompts,
        args.max_new_tokens,
        args.dtype,
    )
    result = ship(
        args.candidate,
        args.dest,
        args.work,
        settings,
        args.min_gain,
        lineage=_lineage(args.candidate),
        served=served_speed if args.speed else None,
    )
    print(
        json.dumps(
            {k: result[k] for k in ("shipped", "gain", "candidate_mean", "shipped_mean", "dest")}
        )
    )
    return 0


def _lineage(candidate: str) -> dict | None:
    """The candidate's lineage, from its run folder's config when its export predates lineage
    records."""
    from draftsmith.distill.engine.warm_start import lineage_from_run
    from draftsmith.evals.flagship import candidate_export

    export, run = candidate_export(candidate)
    try:
        config = json.loads((export / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the ship command names the damage itself
    return lineage_from_run(run, config) if run is not None else None


def _train(args: argparse.Namespace) -> int:
    from draftsmith.evals.flagship_train import train_sitting

    overrides = [o for o in args.overrides if o != "--"]
    flagship = Path(args.flagship) if (Path(args.flagship) / "config.json").is_file() else None
    run, code = train_sitting(args.root, overrides, flagship, args.init)
    if code == 0:
        print(f"trained {run}; offer it to the flagship with: draftsmith flagship ship {run}")
    return code


def _show(args: argparse.Namespace) -> int:
    from draftsmith.evals.flagship import FLAGSHIP_DIR, FlagshipError, read_shipped
    from draftsmith.evals.flagship_record import readme

    dest = Path(args.dest or FLAGSHIP_DIR)
    shipped = read_shipped(dest)
    if shipped is None:
        raise FlagshipError(
            f"nothing is shipped at {dest} yet: draftsmith flagship ship RUN_OR_EXPORT"
        )
    print(readme(shipped))
    return 0


def _table(args: argparse.Namespace) -> int:
    from draftsmith.evals.flagship_record import demo_table

    text = demo_table(args.bench_dirs)
    if args.out:
        from draftsmith.common.atomic_folder import write_file

        write_file(args.out, text)
    print(text)
    return 0


def _cmd(args: argparse.Namespace) -> int:
    return {"ship": _ship, "train": _train, "show": _show, "table": _table}[args.action](args)


def _kept(args: argparse.Namespace) -> str:
    """What an interrupted ``flagship`` command kept."""
    if getattr(args, "action", None) == "ship":
        return (
            "kept the bf16 copy and any finished evaluation under --work (default"
            " $DRAFTSMITH_CACHE/ship) for the resumed command; the shipped drafter is unchanged"
        )
    if getattr(args, "action", None) == "train":
        return (
            f"kept the run's last checkpoint under {args.root}/current, where the same command"
            " resumes"
        )
    return "nothing was written"


KEPT = {"flagship": _kept}
ARGUMENTS = {"flagship": _arguments}
HANDLERS = {"flagship": _cmd}
