"""Fit of a learning curve and what it forecasts: ``a(t) = a_inf - b * t^(-c)`` (acceptance rising
with training tokens ``t`` towards a ceiling ``a_inf``), the usual saturating power law of
data-scaling studies.

The exponent ``c`` is searched on a grid and, for each, ``a_inf`` and ``b`` are the least-squares
line in ``x = t^(-c)``; the fit with the smallest squared error wins. From it:

- ``tokens_for(target)``: the training tokens at which the fit reaches ``target`` (None when the
  ceiling is below it);
- ``flattens_at``: the tokens past which one more doubling of the data adds less than ``FLAT_GAIN``
  acceptance.

Three points at least (two parameters plus the exponent); fewer give no fit. A fit says what more of
the *same* recipe would give; a ceiling below a target says the recipe (capacity or data) must
change, not the budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

FLAT_GAIN = 0.01  # acceptance per doubling of training tokens below which the curve counts as flat
EXPONENTS = tuple(round(0.02 * i, 2) for i in range(1, 76))  # c in 0.02 .. 1.5


@dataclass(frozen=True)
class CurveFit:
    """``a(t) = ceiling - scale * t^(-exponent)``, with its root-mean-square error over the fitted
    points."""

    ceiling: float
    scale: float
    exponent: float
    rmse: float
    points: int

    def at(self, tokens: float) -> float:
        """The fitted acceptance after ``tokens`` training tokens."""
        return self.ceiling - self.scale * tokens ** (-self.exponent)

    def tokens_for(self, target: float) -> float | None:
        """Training tokens at which the fit reaches ``target``; None when its ceiling stays below
        it."""
        if self.scale <= 0 or target >= self.ceiling:
            return None
        return (self.scale / (self.ceiling - target)) ** (1.0 / self.exponent)

    @property
    def flattens_at(self) -> float | None:
        """Tokens past which a doubling adds less than :data:`FLAT_GAIN` (d a / d log2 t = scale c
        ln2 t^-c)."""
        if self.scale <= 0:
            return None
        return (self.scale * self.exponent * math.log(2) / FLAT_GAIN) ** (1.0 / self.exponent)


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least squares ``y = p + q x``: (p, q, sum of squared errors)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    q = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    p = my - q * mx
    return p, q, sum((y - p - q * x) ** 2 for x, y in zip(xs, ys))


def fit_curve(
    tokens: Sequence[float], acceptance: Sequence[float], bound: float = 1.0
) -> CurveFit | None:
    """The best saturating power law through ``(tokens, acceptance)`` whose ceiling is at most
    ``bound`` (1, or the draft vocabulary's coverage of the target's greedy tokens: a token outside
    it is a certain miss); None for fewer than 3 points with t > 0, or when every exponent puts the
    ceiling above the bound (points still on the steep early part)."""
    pairs = [(float(t), float(a)) for t, a in zip(tokens, acceptance) if t > 0]
    if len(pairs) < 3:
        return None
    best: CurveFit | None = None
    for c in EXPONENTS:
        xs = [t ** (-c) for t, _ in pairs]
        ceiling, slope, sse = _line(xs, [a for _, a in pairs])
        fit = CurveFit(ceiling, -slope, c, math.sqrt(sse / len(pairs)), len(pairs))
        if ceiling > bound:  # acceptance cannot rise past it: too few points to place the ceiling
            continue
        if best is None or fit.rmse < best.rmse - 1e-12:
            best = fit
    return best


def forecast(
    fit: CurveFit | None,
    targets: dict[str, float],
    tokens_per_cpu_hour: float | None,
    coverage: float | None = None,
) -> dict:
    """The fit's parameters, where it flattens and, per named target, the tokens (and CPU-hours at
    the measured training rate) it would take, or why it cannot be reached with this recipe;
    ``coverage`` (the draft vocabulary's share of the target's greedy tokens) is the most
    first-position acceptance can reach at all."""
    if fit is None:
        return {
            "fit": None,
            "why": (
                "fewer than 3 evaluated points, or every fit puts the ceiling above what "
                "acceptance can reach (the points are still on the steep early part: train longer)"
            ),
        }

    def hours(tokens: float | None) -> float | None:
        return None if tokens is None or not tokens_per_cpu_hour else tokens / tokens_per_cpu_hour

    out: dict = {
        "fit": asdict(fit),
        "flattens_at_tokens": fit.flattens_at,
        "flattens_at_cpu_hours": hours(fit.flattens_at),
        "targets": {},
    }
    for name, target in targets.items():
        need = fit.tokens_for(target)
        why = (
            None
            if need is not None
            else (
                f"the fitted ceiling {fit.ceiling:.3f} is below {target}: more of this "
                "recipe's data will not get there (capacity or data must change)"
            )
        )
        if coverage is not None and target > coverage:
            need, why = (
                None,
                (
                    f"{target} is above the draft vocabulary's coverage of the target's greedy"
                    f" tokens ({coverage:.3f}): no training reaches it; raise"
                    " drafter.draft_vocab_size"
                ),
            )
        out["targets"][name] = {
            "target": target,
            "tokens": need,
            "cpu_hours": hours(need),
            "reachable": need is not None,
            "why": why,
        }
    return out
