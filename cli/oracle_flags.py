"""The oracle flags of ``draftsmith bench`` (:mod:`draftsmith.bench.oracle`), each range-checked as
it is parsed.

Kept apart from the bench's own flags so that parsing a bench command line still imports no model
code.
"""

from __future__ import annotations

import argparse

from draftsmith.cli.arguments import COUNT, PROBABILITY, Range


def add_oracle_arguments(b: argparse.ArgumentParser) -> None:
    """``--oracle-acceptance P``, ``--oracle-chain K`` and ``--oracle-draft-ms MS``."""
    b.add_argument(
        "--oracle-acceptance",
        type=PROBABILITY,
        default=None,
        metavar="P",
        help=(
            "also bench an oracle chain that drafts the target's greedy continuation, each position"
            " right with probability P given the previous one was: the loop's ceiling at that"
            " acceptance, on this machine (beside --drafter's row, or alone on the target without"
            " one; bench.json oracle)"
        ),
    )
    b.add_argument(
        "--oracle-chain",
        type=COUNT,
        default=None,
        metavar="K",
        help="tokens the oracle drafts a step (default 3)",
    )
    b.add_argument(
        "--oracle-draft-ms",
        type=Range(float, low=0, hint="a simulated drafting cost"),
        default=0.0,
        metavar="MS",
        help="the oracle's drafting cost per call, spin-waited (default 0)",
    )
