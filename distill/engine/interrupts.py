"""Ctrl-C while a checkpoint is written: finish it (or, on a second Ctrl-C, drop it), then stop as an interruption.

A SIGINT that lands inside ``torch.save`` raises ``KeyboardInterrupt`` from within its C++ zip writer, which turns
it into ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos ...``: Lightning then reports a crash
(a traceback, exit status 1) instead of the interruption (one line, 130). :func:`deferred_sigint` holds the first
Ctrl-C until the write is done; :class:`CheckpointInterrupted` (a ``KeyboardInterrupt``) then stops the run with the
new checkpoint complete and linked. A second Ctrl-C abandons the write: its temporary is removed and ``last.ckpt``
keeps naming the previous checkpoint.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


class CheckpointInterrupted(KeyboardInterrupt):
    """Ctrl-C came while a checkpoint was written: ``saved`` is the checkpoint finished before stopping, or None
    when a second Ctrl-C abandoned it (its temporary removed, the previous checkpoint untouched)."""

    def __init__(self, saved: str | None) -> None:
        super().__init__("interrupted while writing a checkpoint")
        self.saved = saved


@contextmanager
def deferred_sigint(what: str) -> Iterator[dict[str, int]]:
    """Hold Ctrl-C while the block writes ``what``: yields ``{"count": n}``, the Ctrl-Cs received. The first is only
    noted (and said); a second raises ``KeyboardInterrupt`` at once. Outside the main thread, or where SIGINT is
    ignored (Lightning's shutdown), nothing changes."""
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
        log.warning("Ctrl-C: finishing %s first, then stopping (Ctrl-C again abandons it; the previous checkpoint "
                    "stays)", what)

    signal.signal(signal.SIGINT, hold)
    try:
        yield pending
    finally:
        signal.signal(signal.SIGINT, previous)
