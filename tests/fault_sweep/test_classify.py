"""The fault sweep's classifier (classify.py) on hand-made outcomes: each class, and the order in
which they win."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from classify import Seen, classify, error_lines  # noqa: E402

pytestmark = pytest.mark.unit

LINE = "draftsmith bench: error: --out /x is a file, not a folder: nothing was written"
TRACE = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: boom\n'


@pytest.mark.parametrize(
    "seen,expect,mentions,outcome",
    [
        (Seen(2, LINE), "refuse", ("--out",), "clean"),
        (Seen(1, "error: unknown recipe 'x'"), "refuse", ("x",), "clean"),
        (Seen(2, LINE), "refuse", ("--target",), "unclear"),  # the line misses what it must name
        (Seen(2, LINE + "\n" + LINE), "refuse", (), "unclear"),  # two error lines
        (Seen(2, "something went wrong"), "refuse", (), "unclear"),  # no error line at all
        (Seen(3, LINE), "refuse", (), "unclear"),  # an exit status a refusal never has
        (Seen(0, ""), "refuse", (), "silent"),
        (
            Seen(1, TRACE + "draftsmith x: internal error (ValueError): this is a bug"),
            "refuse",
            (),
            "traceback",
        ),
        (Seen(None, ""), "refuse", (), "wedged"),
        (
            Seen(2, LINE, rerun_returncode=1, rerun_stderr="error: same again"),
            "refuse",
            (),
            "wedged",
        ),
        (Seen(2, LINE, rerun_returncode=None), "refuse", (), "wedged"),
        (Seen(2, LINE, changed=["/data.jsonl"]), "refuse", (), "data-loss"),
        (Seen(2, LINE, code_ran=True, changed=["/x"]), "refuse", (), "code-run"),
        (Seen(0, "", rerun_returncode=0), "ok", (), "ok"),
        (Seen(1, "error: broke"), "ok", (), "broken"),
        (
            Seen(130, "draftsmith regenerate: interrupted (Ctrl-C): kept 3 lines"),
            "interrupt",
            ("interrupted",),
            "clean",
        ),
        (Seen(1, "draftsmith regenerate: interrupted (Ctrl-C)"), "interrupt", (), "unclear"),
        (Seen(130, "no line"), "interrupt", (), "unclear"),
    ],
)
def test_each_outcome_class(seen, expect, mentions, outcome):
    assert classify(seen, expect, mentions)[0] == outcome


def test_a_requested_traceback_is_not_held_against_the_case():
    seen = Seen(2, TRACE + LINE)
    assert classify(seen, "refuse", (), traceback_ok=True)[0] == "clean"
    assert classify(seen, "refuse", ())[0] == "traceback"


def test_error_lines_are_the_ones_with_an_error_prefix():
    text = (
        "INFO x: loading\nWARNING y: slow\n"
        + LINE
        + "\nerror: plain train.py line\nterror: not one"
    )
    assert error_lines(text) == [LINE, "error: plain train.py line"]
