"""The learning curve's picture, ``curve.png``: acceptance against training tokens on a log axis,
CPU-hours on the top axis, the raw points hollow, the cooled ones filled, the fit of the cooled ones
dashed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftsmith.evals.curve_pick import reading_points
from draftsmith.evals.curve_report import prompt_sets, tokens_per_cpu_hour


def plot(data: dict[str, Any], fit_block: dict[str, Any], path: Path) -> None:
    """Acceptance (first position, solid; fit, dashed) against training tokens, log x, CPU-hours on
    top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in data["points"] if p.get("tokens")]
    read, values = reading_points(data)
    cooled = [p for p in read if p.get("tokens")] if values == "cooled" else []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p["tokens"] for p in [*points, *cooled]]
    for name in prompt_sets(data):
        color = _plot_readings(ax, name, points, cooled, values)
        fit = fit_block.get(name, {}).get("fit")
        if fit and xs:
            _plot_fit(ax, name, fit, xs, color)
    rate = tokens_per_cpu_hour(points)
    if rate:
        top = ax.secondary_xaxis("top", functions=(lambda t: t / rate, lambda h: h * rate))
        top.set_xlabel("CPU-hours of training")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out acceptance")
    ax.set_ylim(0, 1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_readings(ax: Any, name: str, points: list[dict], cooled: list[dict], values: str) -> Any:
    """Prompt set ``name``'s first-position acceptance (raw hollow, cooled filled) and its
    all-of-4 acceptance; returns the set's line colour."""
    (line,) = ax.plot(
        [p["tokens"] for p in points],
        [p["eval"][name]["first_position_acceptance"] for p in points],
        "o-",
        mfc="none",
        label=f"{name} first position (raw)",
    )
    if cooled:
        ax.plot(
            [p["tokens"] for p in cooled],
            [p["eval"][name]["first_position_acceptance"] for p in cooled],
            "D-",
            color=line.get_color(),
            label=f"{name} first position (cooled)",
        )
    deeper = [p["eval"][name]["chain_acceptance"][-1] for p in cooled or points]
    ax.plot(
        [p["tokens"] for p in cooled or points],
        deeper,
        "s:",
        color=line.get_color(),
        alpha=0.6,
        label=f"{name} all of 4 ({values})",
    )
    return line.get_color()


def _plot_fit(ax: Any, name: str, fit: dict[str, float], xs: list[int], color: Any) -> None:
    """The fit ``ceiling - scale * t^-exponent``, dashed, from the first point to 20x the last."""
    grid = [min(xs) * (max(xs) * 20 / min(xs)) ** (i / 60) for i in range(61)]
    ax.plot(
        grid,
        [fit["ceiling"] - fit["scale"] * g ** (-fit["exponent"]) for g in grid],
        "--",
        color=color,
        alpha=0.7,
        label=f"{name} fit (ceiling {fit['ceiling']:.2f})",
    )
