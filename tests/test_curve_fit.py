"""The learning curve's plan and fit (`draftsmith curve`): log-spaced steps, the saturating fit of
acceptance against training tokens, and its forecast of the tokens a target needs (or that the
draft vocabulary's coverage makes it unreachable)."""

from __future__ import annotations

import math

import pytest

from draftsmith.evals.curve_fit import fit_curve, forecast
from draftsmith.evals.curve_runner import CurveError, log_spaced_steps

pytestmark = pytest.mark.unit


def test_plan_is_log_spaced_increasing_and_ends_at_the_budget():
    plan = log_spaced_steps(10, 1000, 5)
    assert plan == [10, 32, 100, 316, 1000]
    assert log_spaced_steps(1, 3, 6) == [1, 2, 3]  # rounding collapses duplicates
    with pytest.raises(CurveError, match="first-steps"):
        log_spaced_steps(100, 10, 3)


def test_fit_recovers_a_known_curve_and_forecasts_the_tokens_of_a_target():
    tokens = [1e4 * 3**i for i in range(7)]
    truth = [0.8 - 2.0 * t**-0.3 for t in tokens]
    fit = fit_curve(tokens, truth)
    assert fit is not None and fit.rmse < 1e-3
    assert fit.ceiling == pytest.approx(0.8, abs=0.01) and fit.exponent == pytest.approx(
        0.3, abs=0.03
    )
    need = fit.tokens_for(0.75)
    assert need == pytest.approx((2.0 / 0.05) ** (1 / 0.3), rel=0.25)
    assert fit.tokens_for(0.9) is None  # above the ceiling: unreachable with this recipe
    flat = fit.flattens_at
    assert flat is not None and fit.at(2 * flat) - fit.at(flat) == pytest.approx(0.01, rel=0.1)
    assert fit_curve(tokens[:2], truth[:2]) is None
    steep = [
        0.1 * math.log(t) - 0.9 for t in tokens
    ]  # still rising in log: the fit never places a ceiling above 1
    assert (fit_curve(tokens, steep) or fit).ceiling <= 1.0
    capped = fit_curve(
        tokens, truth, bound=0.7
    )  # a draft vocabulary covering 70% of the target's greedy tokens
    assert capped is None or capped.ceiling <= 0.7


def test_a_target_above_the_draft_vocabularys_coverage_is_named_unreachable():
    tokens = [1e4 * 3**i for i in range(7)]
    fit = fit_curve(tokens, [0.8 - 2.0 * t**-0.3 for t in tokens])
    out = forecast(fit, {"first_position": 0.75}, 1e5, coverage=0.72)
    target = out["targets"]["first_position"]
    assert not target["reachable"] and target["tokens"] is None
    assert (
        "above the draft vocabulary's coverage" in target["why"]
        and "drafter.draft_vocab_size" in target["why"]
    )
    assert forecast(fit, {"first_position": 0.75}, 1e5, coverage=0.95)["targets"]["first_position"][
        "reachable"
    ]
