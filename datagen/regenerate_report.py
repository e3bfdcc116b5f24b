"""What a ``draftsmith regenerate`` run did (conversations written, resumed, skipped and why,
tokens, pace) and the summary the command prints at its end."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RegenerateReport:
    """What a run did; ``skipped`` maps a reason to a count of conversations not written."""

    written: int = 0
    resumed: int = 0  # lines already in the .partial file when the run started
    truncated: int = 0  # "all" mode: later turns cut because the context was full
    tokens: int = 0
    seconds: float = 0.0
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def summary(report: RegenerateReport, out: str | Path) -> str:
    """The one-paragraph summary printed at the end of ``draftsmith regenerate``."""
    skipped = ", ".join(f"{n} {why}" for why, n in report.skipped.items()) or "none"
    return (
        f"wrote {out}: {report.written + report.resumed} conversations ({report.resumed} resumed,"
        f" {report.truncated} truncated at the context), skipped: {skipped}; generated"
        f" {report.tokens} tokens in {report.seconds:.1f} s ({report.tokens_per_s:.1f} tokens/s)"
    )


__all__ = ["RegenerateReport", "summary"]
