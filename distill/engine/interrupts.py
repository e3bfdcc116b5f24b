"""Ctrl-C during training: one interruption (:class:`TrainingInterrupted`, exit 130 in train.py),
whatever it hits.

:func:`interruptible` wraps ``trainer.fit`` and the final ``trainer.validate``: Lightning turns a
KeyboardInterrupt into ``sys.exit(1)``; :class:`InterruptWatch` (its ``on_exception`` hook) tells
that exit apart from any other.

Ctrl-C while a checkpoint is written: finish it (or, on a second Ctrl-C, drop it), then stop as an
interruption.

A SIGINT that lands inside ``torch.save`` raises ``KeyboardInterrupt`` from within its C++ zip
writer, which turns it into ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos
...``: Lightning then reports a crash (a traceback, exit status 1) instead of the interruption (one
line, 130). :func:`deferred_sigint` holds the first Ctrl-C until the write is done;
:class:`CheckpointInterrupted` (a ``KeyboardInterrupt``) then stops the run with the new checkpoint
complete and linked. A second Ctrl-C abandons the write: its temporary is removed and ``last.ckpt``
keeps naming the previous checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.io import TorchCheckpointIO

from draftsmith.common.errors import TrainingInterrupted

log = logging.getLogger(__name__)


class CheckpointInterrupted(KeyboardInterrupt):
    """Ctrl-C came while a checkpoint was written: ``saved`` is the checkpoint finished before
    stopping, or None when a second Ctrl-C abandoned it (its temporary removed, the previous
    checkpoint untouched)."""

    def __init__(self, saved: str | None) -> None:
        super().__init__("interrupted while writing a checkpoint")
        self.saved = saved


@contextmanager
def deferred_sigint(what: str) -> Iterator[dict[str, int]]:
    """Hold Ctrl-C while the block writes ``what``: yields ``{"count": n}``, the Ctrl-Cs received.
    The first is only noted (and said); a second raises ``KeyboardInterrupt`` at once. Outside the
    main thread, or where SIGINT is ignored (Lightning's shutdown), nothing changes."""
    pending = {"count": 0}
    if threading.current_thread() is not threading.main_thread():
        yield pending
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous in (signal.SIG_IGN, None):
        yield pending
        return

    def hold(signum: int, frame: object) -> None:
        pending["count"] += 1
        if pending["count"] > 1:
            raise KeyboardInterrupt
        log.warning(
            "Ctrl-C: finishing %s first, then stopping (Ctrl-C again abandons it; the previous"
            " checkpoint stays)",
            what,
        )

    signal.signal(signal.SIGINT, hold)
    try:
        yield pending
    finally:
        signal.signal(signal.SIGINT, previous)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temp file, fsyncs, then renames: a kill mid-write never corrupts
    ``last.ckpt``. Ctrl-C during the write finishes it first (a second Ctrl-C drops it), then stops
    as an interruption (:mod:`draftsmith.distill.engine.interrupts`)."""

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike,
        storage_options: Any | None = None,
    ) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with deferred_sigint(f"the checkpoint {path.name}") as pending:
            try:
                with open(tmp, "wb") as fh:
                    torch.save(checkpoint, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
            except BaseException:
                tmp.unlink(missing_ok=True)
                # torch's C++ writer turned the second Ctrl-C into a RuntimeError
                if pending["count"] > 1:
                    raise CheckpointInterrupted(None) from None
                raise
            os.replace(tmp, path)
        if pending["count"]:
            raise CheckpointInterrupted(str(path))


class InterruptWatch(pl.Callback):
    """Notes a Ctrl-C during ``fit``: Lightning catches the KeyboardInterrupt, shuts down and calls
    ``sys.exit(1)``, and only its ``on_exception`` hook tells that exit apart from any other."""

    interrupted = False

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if isinstance(exception, KeyboardInterrupt):
            self.interrupted = True


def interruptible(
    trainer: pl.Trainer, run_dir: Path, checkpoint_every: int, call: Any, *args: Any, **kwargs: Any
) -> Any:
    """``call(*args, **kwargs)`` (``trainer.fit`` or ``trainer.validate``) that turns Ctrl-C into
    :class:`TrainingInterrupted` (step, newest checkpoint, run folder) instead of Lightning's bare
    exit status 1.
    """
    watch = next((c for c in trainer.callbacks if isinstance(c, InterruptWatch)), None)
    try:
        return call(*args, **kwargs)
    except (SystemExit, KeyboardInterrupt) as err:
        if isinstance(err, SystemExit) and not (watch is not None and watch.interrupted):
            raise
        # Lightning ignores SIGINT while it shuts down; a process that lives on gets Ctrl-C back
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        except ValueError:  # not the main thread
            pass
        # (checkpoints, which resume_point imports, imports this module)
        from draftsmith.distill.engine.resume_point import find_resume_checkpoint

        found = find_resume_checkpoint(run_dir)
        raise TrainingInterrupted(
            int(trainer.global_step), str(found) if found else None, str(run_dir), checkpoint_every
        ) from None


def fit_or_interrupted(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    data: Any,
    ckpt_path: str | None,
    run_dir: Path,
    checkpoint_every: int,
) -> None:
    """``trainer.fit`` with Ctrl-C as :class:`TrainingInterrupted` (:func:`interruptible`)."""
    interruptible(
        trainer,
        run_dir,
        checkpoint_every,
        trainer.fit,
        module,
        datamodule=data,
        ckpt_path=ckpt_path,
    )
