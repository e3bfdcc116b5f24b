"""How one fault case's outcome is read: a pure function of what the runner saw, so it is
unit-tested on its own (tests/fault_sweep/test_classify.py).

Outcome classes, worst first (a case gets the first that applies):

* ``code-run``: a model folder's own Python ran without ``--trust-remote-code`` (its marker file
  appeared);
* ``data-loss``: an input the case protects changed or vanished (``append`` protection: its old
  bytes are no longer a prefix of the new ones);
* ``wedged``: the command hung past its timeout, or the follow-up run that must succeed after the
  fault failed;
* ``traceback``: a Python traceback on stderr that nobody asked for (an ``internal error`` line says
  it is a bug);
* ``silent``: a refusal was expected and the command exited 0;
* ``unclear``: refused without a traceback but not in one ``error:`` line, or the line misses what
  it must name (the case's ``mentions``), or an unexpected exit status;
* ``broken``: a control case (expected to work) failed;
* ``clean``: refused in one line naming what it must; ``ok``: a control case worked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

CLASSES = (
    "clean",
    "ok",
    "unclear",
    "silent",
    "traceback",
    "broken",
    "wedged",
    "data-loss",
    "code-run",
)
GOOD = ("clean", "ok")
ERROR_LINE = re.compile(r"(^|: )error: ")
INTERRUPT_LINE = re.compile(r"interrupted")
REFUSAL_EXITS = (1, 2)
INTERRUPT_EXIT = 130


@dataclass
class Seen:
    """What the runner observed for one case."""

    returncode: int | None  # None: killed at the timeout
    stderr: str
    stdout: str = ""
    changed: list[str] = field(default_factory=list)  # protected inputs that changed or vanished
    code_ran: bool = False
    rerun_returncode: int | None = -1  # -1: no follow-up run; None: it hung
    rerun_stderr: str = ""


def error_lines(stderr: str) -> list[str]:
    """The ``error:`` lines of ``stderr`` (``draftsmith CMD: error: ...`` or ``error: ...``)."""
    return [line for line in stderr.splitlines() if ERROR_LINE.search(line)]


def _missing(line: str, mentions: tuple[str, ...]) -> list[str]:
    return [m for m in mentions if m.lower() not in line.lower()]


def _refusal(seen: Seen, mentions: tuple[str, ...], interrupt: bool) -> tuple[str, str]:
    """Class of a run expected to stop (refused, or interrupted by the case)."""
    if seen.returncode == 0:
        return "silent", "exited 0: the bad input was accepted"
    if interrupt:
        lines = [
            ln
            for ln in seen.stderr.splitlines()
            if INTERRUPT_LINE.search(ln) and "WARNING" not in ln
        ]
        if seen.returncode != INTERRUPT_EXIT:
            return "unclear", f"Ctrl-C exit {seen.returncode}, not {INTERRUPT_EXIT}"
        if len(lines) != 1:
            return "unclear", f"{len(lines)} interruption lines"
        missing = _missing(lines[0], mentions)
        return ("unclear", f"the line does not name {missing}") if missing else ("clean", lines[0])
    lines = error_lines(seen.stderr)
    if seen.returncode not in REFUSAL_EXITS:
        return "unclear", f"exit {seen.returncode} for a refusal"
    if len(lines) != 1:
        return "unclear", f"{len(lines)} error lines" + (f": {lines[:2]}" if lines else "")
    missing = _missing(lines[0], mentions)
    return (
        ("unclear", f"the line does not name {missing}: {lines[0]}")
        if missing
        else ("clean", lines[0])
    )


def classify(
    seen: Seen, expect: str = "refuse", mentions: tuple[str, ...] = (), traceback_ok: bool = False
) -> tuple[str, str]:
    """(outcome class, reason) of one case; ``expect``: ``refuse`` (a bad input or a fault),
    ``interrupt`` (the runner sent Ctrl-C) or ``ok`` (a control that must work); ``traceback_ok``:
    the case asked for tracebacks.
    """
    if seen.code_ran:
        return "code-run", "a model folder's own code ran without --trust-remote-code"
    if seen.changed:
        return "data-loss", "changed: " + ", ".join(seen.changed[:3])
    if seen.returncode is None:
        return "wedged", "hung past the timeout"
    if seen.rerun_returncode is None:
        return "wedged", "the follow-up run hung"
    if seen.rerun_returncode not in (-1, 0):
        rerun_lines = error_lines(seen.rerun_stderr) or seen.rerun_stderr.strip().splitlines()[-1:]
        return (
            "wedged",
            (
                f"the follow-up run failed (exit {seen.rerun_returncode}):"
                f" {' '.join(rerun_lines)[:160]}"
            ),
        )
    if "Traceback (most recent call last)" in seen.stderr and not traceback_ok:
        last = seen.stderr.strip().splitlines()[-1] if seen.stderr.strip() else ""
        return "traceback", last[:200]
    if expect == "ok":
        if seen.returncode == 0:
            return "ok", "worked"
        return "broken", f"exit {seen.returncode}: {' '.join(error_lines(seen.stderr))[:200]}"
    return _refusal(seen, mentions, interrupt=expect == "interrupt")


__all__ = ["CLASSES", "GOOD", "Seen", "classify", "error_lines"]
