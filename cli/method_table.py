"""``draftsmith method-table``: train each recipe for the same steps on the same batches, bench each
export at its own tree or depth, and write ``table.json``, ``table.md`` and ``table.png``
(:mod:`draftsmith.evals.method_table`). The recipes and labels come from the recipes'
registrations; the same command resumes an interrupted table.

    draftsmith method-table --steps 80 --out outputs/method_table   # every in_method_table recipe
    draftsmith method-table --recipes medusa,eagle3 --steps 40 --out /tmp/t   # a subset
    draftsmith method-table --recipes medusa@heads.draft_vocab_size=8192   # a recipe with overrides
"""

from __future__ import annotations

import argparse
from pathlib import Path

from draftsmith.cli.arguments import COUNT
from draftsmith.common.errors import InputError


def _method_table_arguments(p: argparse.ArgumentParser) -> None:
    from draftsmith.evals.method_table import TABLE_BENCH_ARGS
    from draftsmith.recipes import method_table_recipes

    p.description = __doc__.split("\n\n")[0]
    p.add_argument(
        "--recipes",
        default=",".join(method_table_recipes()),
        help="comma-separated recipe specs, each recipe[@override@...] (default: the table's own)",
    )
    p.add_argument(
        "--steps", type=COUNT, default=80, help="optimizer steps per recipe (the same batches each)"
    )
    p.add_argument("--out", default="outputs/method_table", help="table folder (resumes there)")
    p.add_argument(
        "--bench-args",
        default=TABLE_BENCH_ARGS,
        help="arguments for `draftsmith bench export` (export = each method's own tree/depth)",
    )
    p.add_argument(
        "--default-bench",
        default="all",
        help="specs also benched with default settings (cost-aware policy): all, none or a list",
    )
    p.add_argument(
        "--skip-training-ratio",
        action="store_true",
        help="skip `draftsmith bench-train` per recipe (extra parameters counted in the export)",
    )


def _specs(recipes: str) -> list[str]:
    """The ``--recipes`` specs; one line naming an unknown recipe (or an empty list) and the valid
    ones."""
    from draftsmith.recipes import recipe_names

    specs = [s.strip() for s in recipes.split(",") if s.strip()]
    if not specs:
        raise InputError("--recipes names no recipe: give recipe[@override@...], comma-separated")
    valid = recipe_names()
    unknown = [s.split("@")[0] for s in specs if s.split("@")[0] not in valid]
    if unknown:
        raise InputError(
            f"--recipes: unknown recipe {', '.join(map(repr, unknown))}; valid recipes:"
            f" {', '.join(valid)}"
        )
    return specs


def _default_bench(value: str, specs: list[str]) -> frozenset[str] | None:
    """``--default-bench``: None for all, the empty set for none, else the listed specs (each one
    of ``--recipes``)."""
    if value == "all":
        return None
    if value == "none":
        return frozenset()
    listed = [s for s in value.split(",") if s]
    stray = [s for s in listed if s not in specs]
    if stray:
        raise InputError(
            f"--default-bench {value}: {', '.join(stray)} not in --recipes; give all, none or specs"
            " of --recipes"
        )
    return frozenset(listed)


def cmd_method_table(args: argparse.Namespace) -> int:
    """Check the options, run (or resume) the table and print it."""
    from draftsmith.cli.preflight import check_out_folder
    from draftsmith.evals.method_table import TableSettings, markdown, run_table
    from draftsmith.recipes import labels

    specs = _specs(args.recipes)
    settings = TableSettings(
        out=check_out_folder("method-table", args.out),
        steps=args.steps,
        bench_args=tuple(args.bench_args.split()),
        default_bench=_default_bench(args.default_bench, specs),
        training_ratio=not args.skip_training_ratio,
        labels=labels(),
    )
    rows = run_table(specs, settings)
    print(markdown(rows))
    return 0


def _method_table_kept(args: argparse.Namespace) -> str:
    """What an interrupted ``method-table`` kept: every finished stage under ``OUT/runs``."""
    out = Path(args.out)
    return (
        f"kept every finished stage in {out / 'runs'} and the finished rows in"
        f" {out / 'table.json'} (the same command resumes)"
        if out.exists()
        else "nothing was written yet"
    )


ARGUMENTS = {"method-table": _method_table_arguments}
HANDLERS = {"method-table": cmd_method_table}
# command -> what a Ctrl-C kept, for the one line :func:`draftsmith.cli.main` prints
KEPT = {"method-table": _method_table_kept}
