"""Acceptance over long outputs: tau by output window, so that a drafter whose acceptance decays
with the output's length shows it (``draftsmith bench export --window W``, ``--long``).

The runtime records how many drafted tokens each verify step accepted
(``SpecResult.accepted_per_step``); a step emits its accepted tokens plus the target's bonus token,
and the first output token comes from the prefill (no verify step). So step ``i`` starts at output
position ``1 + sum_{j<i} (a_j + 1)``, exactly, without any extra recording. Each step counts in the
window where its first emitted token lands: a window's tau is the tokens those steps emitted over
their number (the target forwards), pooled over prompts. A step that runs past the window's end
counts where it began, so every step counts once and the windows' forwards add up to the run's.
Windows no step reached (every prompt stopped at EOS earlier: the bench has no option to ignore EOS)
are left out; ``prompts`` says how many reached each.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from draftsmith.common.errors import InputError

DEFAULT_WINDOW = 256  # output tokens per window
LONG_PRESET = {"num_prompts": 2, "max_new_tokens": 2048, "window": 256}  # ``bench --long``


def step_starts(accepted_per_step: Sequence[int]) -> list[int]:
    """Output position of the first token each verify step emitted (position 0 is the prefill's
    token)."""
    starts, position = [], 1
    for accepted in accepted_per_step:
        starts.append(position)
        position += int(accepted) + 1  # accepted drafts + the bonus token
    return starts


def tau_by_window(
    accepted_per_prompt: Sequence[Sequence[int]], window: int, max_new_tokens: int
) -> list[dict[str, Any]]:
    """Windows of ``window`` output tokens, in order: ``{start, end, tau, forwards, prompts}``, one
    per window some step started in (module docstring). ``accepted_per_prompt``: each prompt's
    accepted counts per step.
    """
    if window < 1:
        raise InputError(f"the window must be >= 1 output token, got {window}")
    by_window: dict[int, list[int]] = {}
    reached: dict[int, int] = {}
    for accepted in accepted_per_prompt:
        seen = set()
        for start, a in zip(step_starts(accepted), accepted):
            index = start // window
            by_window.setdefault(index, []).append(int(a))
            seen.add(index)
        for index in seen:
            reached[index] = reached.get(index, 0) + 1
    from draftsmith.runtime.decoding import (
        metrics,
    )  # lazy: `bench --long` reads the preset before serving starts

    # a window ends at max_new_tokens when that cuts it (the max() only keeps end > start on
    # inconsistent input)
    return [
        {
            "start": i * window,
            "end": min((i + 1) * window, max(max_new_tokens, i * window + 1)),
            "tau": metrics.tau(by_window[i]),
            "forwards": len(by_window[i]),
            "prompts": reached[i],
        }
        for i in sorted(by_window)
    ]


def windows_text(windows: list[dict[str, Any]] | None, note: str | None = None) -> str:
    """The compact markdown cell: ``0-256: 2.31 (40 fwd, 2 prompts); 256-512: ...``."""
    if not windows:
        return note or "n/a"
    return "; ".join(
        f"{w['start']}-{w['end']}: {w['tau']:.2f} ({w['forwards']} fwd, {w['prompts']} prompts)"
        for w in windows
    )


def plot_windows(ax: Any, series: dict[str, list[dict[str, Any]]]) -> None:
    """Tau against output position on ``ax`` (matplotlib): one line per drafter, a point at each
    window's middle."""
    top = 1.0
    for label, windows in series.items():
        x = [(w["start"] + w["end"]) / 2 for w in windows]
        ax.plot(x, [w["tau"] for w in windows], marker="o", label=label)
        top = max([top, *(w["tau"] for w in windows)])
    ax.axhline(
        1.0, color="grey", linewidth=0.8, linestyle="--"
    )  # tau 1: nothing accepted, plain decoding's rate
    ax.set_xlabel("output position (tokens)")
    ax.set_ylabel("tau in the window")
    ax.set_ylim(0, top * 1.15)  # room above the highest point for the legend
    ax.legend(fontsize=8, loc="lower right")


def apply_preset(args: argparse.Namespace) -> None:
    """Fill the bench's ``max_new_tokens`` and ``window`` (and with ``--long`` ``num_prompts``)
    where not given: 128 tokens and :data:`DEFAULT_WINDOW`, or :data:`LONG_PRESET` with
    ``args.long``."""
    preset = (
        LONG_PRESET
        if getattr(args, "long", False)
        else {"max_new_tokens": 128, "window": DEFAULT_WINDOW}
    )
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
