"""Short human durations for progress lines (shared by the training bar and the runtime's long
jobs)."""

from __future__ import annotations


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s`` or ``2h07m``: short enough for a progress bar postfix."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def eta_seconds(done: int, total: int, seconds: float) -> float | None:
    """Seconds left at the pace so far (``done`` of ``total`` items in ``seconds``); None before the
    first item."""
    if done <= 0 or seconds <= 0:
        return None
    return max(0, total - done) * seconds / done
