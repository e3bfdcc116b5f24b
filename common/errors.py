"""Errors draftsmith raises on purpose: bad config, bad data, a diverged run.

``train.py`` prints any :class:`DraftsmithError` as one ``error: ...`` line (the traceback only with
``HYDRA_FULL_ERROR=1``); anything else is a bug and keeps its traceback. Each class also derives from the
builtin type the code raised before (``ValueError``, ``RuntimeError``, ...), so ``except ValueError`` callers and
``pytest.raises(ValueError)`` keep working.
"""

from __future__ import annotations


class DraftsmithError(Exception):
    """Base of every error draftsmith raises on purpose, with a message meant for the user."""


class ConfigError(DraftsmithError, ValueError):
    """A config value is missing, out of range or unusable on this machine."""


class DataError(DraftsmithError, ValueError):
    """The training data cannot be used: empty, malformed, or nothing left to train on."""


class DataFileNotFoundError(DraftsmithError, FileNotFoundError):
    """A data file named in the config does not exist."""


class MissingDependencyError(DraftsmithError, ImportError):
    """An optional package the config asks for is not installed."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped training: ``step`` reached, the newest ``checkpoint`` on disk (None if none yet) and the run
    folder it resumes from. A ``KeyboardInterrupt``, so code that catches that still does; ``train.py`` reports it
    with the command that resumes, exit status 130."""

    def __init__(self, step: int, checkpoint: str | None, run_dir: str, checkpoint_every: int | None = None) -> None:
        super().__init__(f"interrupted at step {step}")
        self.step, self.checkpoint, self.run_dir, self.checkpoint_every = step, checkpoint, run_dir, checkpoint_every
