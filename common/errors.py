"""Errors draftsmith raises on purpose, and what a command prints when it fails.

Every error the project raises on purpose (bad input, bad config, bad data, a damaged file, a
diverged run) derives from :class:`DraftsmithError`, in whichever room it is raised; each also
derives from the builtin type the code raised before (``ValueError``, ``RuntimeError``,
``OSError``...), so ``except ValueError`` callers and ``pytest.raises(ValueError)`` keep working.
:func:`report_failure` is the one policy every entry point (the ``draftsmith`` command,
``train.py``) applies: a :class:`DraftsmithError` is one ``error:`` line (the traceback only on
request: ``--traceback``, ``DRAFTSMITH_TRACEBACK=1`` or ``DRAFTSMITH_DEBUG=1``); anything else is a
bug in draftsmith, printed with its traceback and a line saying so and where to report it.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import TextIO

TRACEBACK_ENV = (
    "DRAFTSMITH_TRACEBACK",
    "DRAFTSMITH_DEBUG",
)  # either, set to 1, shows the traceback of any error
REPORT_TO = (
    "the draftsmith issue tracker (the repository's issues), with the command line and the"
    " traceback above"
)


class DraftsmithError(Exception):
    """Base of every error draftsmith raises on purpose, with a message meant for the user."""


class InputError(DraftsmithError, ValueError):
    """A command-line value, a file or a folder the user passed cannot be used (named, with the
    fix)."""


class InputNotFoundError(DraftsmithError, FileNotFoundError):
    """A file or folder the user named does not exist."""


class ConfigError(DraftsmithError, ValueError):
    """A config value is missing, out of range or unusable on this machine."""


class DataError(DraftsmithError, ValueError):
    """The training data cannot be used: empty, malformed, or nothing left to train on."""


class DataFileNotFoundError(DraftsmithError, FileNotFoundError):
    """A data file named in the config does not exist."""


class MissingDependencyError(DraftsmithError, ImportError):
    """An optional package the config asks for is not installed."""


class RemoteCodeRefused(DraftsmithError, ValueError):
    """A model folder ships its own Python code and the user did not pass
    ``--trust-remote-code``."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped training: ``step`` reached, the newest ``checkpoint`` on disk (None if none
    yet) and the run folder it resumes from. A ``KeyboardInterrupt``, so code that catches that
    still does; ``train.py`` reports it with the command that resumes, exit status 130."""

    def __init__(
        self, step: int, checkpoint: str | None, run_dir: str, checkpoint_every: int | None = None
    ) -> None:
        super().__init__(f"interrupted at step {step}")
        self.step, self.checkpoint, self.run_dir, self.checkpoint_every = (
            step,
            checkpoint,
            run_dir,
            checkpoint_every,
        )


def traceback_requested() -> bool:
    """Whether the user asked for tracebacks (``DRAFTSMITH_TRACEBACK=1`` / ``DRAFTSMITH_DEBUG=1``;
    ``--traceback`` sets the first)."""
    return any(os.environ.get(name, "") not in ("", "0") for name in TRACEBACK_ENV)


def one_line(err: BaseException | str) -> str:
    """The message of ``err`` on one line (whitespace runs collapsed); the class name when it has
    none."""
    text = " ".join(str(err).split())
    return text or type(err).__name__


def is_purposeful(err: BaseException) -> bool:
    """True for an error draftsmith raised on purpose (its message is for the user)."""
    return isinstance(err, DraftsmithError)


def report_failure(
    err: BaseException, prog: str, user_exit: int = 2, stream: TextIO | None = None
) -> int:
    """Print what a command that stopped on ``err`` shows, and return its exit status.

    A :class:`DraftsmithError` is one ``PROG: error: ...`` line (``user_exit``), preceded by its
    traceback only when :func:`traceback_requested`. Anything else is a bug: its traceback, then one
    line saying it is a bug in draftsmith and where to report it (exit 1), so a bug never reads like
    a mistake of the user's. An empty ``prog`` prints the lines without it (``train.py``'s ``error:
    ...``)."""
    stream, head = stream or sys.stderr, f"{prog}: " if prog else ""
    if is_purposeful(err):
        if traceback_requested():
            traceback.print_exception(type(err), err, err.__traceback__, file=stream)
        print(f"{head}error: {one_line(err)}", file=stream, flush=True)
        return user_exit
    traceback.print_exception(type(err), err, err.__traceback__, file=stream)
    print(
        f"{head}internal error ({type(err).__name__}): this is a bug in draftsmith, not a problem"
        f" with your input; please report it to {REPORT_TO}",
        file=stream,
        flush=True,
    )
    return 1


__all__ = [
    "ConfigError",
    "DataError",
    "DataFileNotFoundError",
    "DraftsmithError",
    "InputError",
    "InputNotFoundError",
    "MissingDependencyError",
    "RemoteCodeRefused",
    "TrainingInterrupted",
    "is_purposeful",
    "one_line",
    "report_failure",
    "traceback_requested",
]
