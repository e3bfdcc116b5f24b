"""LPO losses on hand-computed log-probabilities: the separate (Eq. 10), joint and latent forms,
value and gradient."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.distill.losses.lpo import (
    LOG_ZERO,
    lpo_loss,
    mixture_log_likelihood,
    tempered_token_log_probs,
)

pytestmark = pytest.mark.unit

GRID = (0.5, 1.0)


def nll_sigmoid(x: float) -> float:
    return -math.log(1.0 / (1.0 + math.exp(-x)))


def one_pair():
    """One pair of two-position rows (position 0 chose the temperature of the token at position 1),
    V = 2.

    Chosen: token 1 sampled at tau=0.5, head P(tau) = [0.8, 0.2]. Rejected: token 0 at tau=1.0, head
    [0.3, 0.7]. Logits [0, ln 3]: at tau=1 p = [0.25, 0.75]; at tau=0.5 p = [0.1, 0.9].
    """
    log_pi = torch.log(
        torch.tensor([[[0.8, 0.2], [0.5, 0.5]], [[0.3, 0.7], [0.5, 0.5]]])
    ).requires_grad_()
    index = torch.tensor([[0, -1], [1, -1]])
    first = torch.tensor([0, 0])
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]]).expand(2, 2, 2)
    tokens = torch.tensor([[1, 0], [0, 0]])
    return log_pi, index, first, tempered_token_log_probs(logits, tokens, GRID)


def test_tempered_token_log_probs_and_the_greedy_point_mass():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    lp = tempered_token_log_probs(
        logits.expand(1, 2, 2), torch.tensor([[1, 0]]), (0.0, 0.5, 1.0)
    )  # [1, 2, 3]
    torch.testing.assert_close(lp[0, 0], torch.tensor([0.0, math.log(0.9), math.log(0.75)]))
    torch.testing.assert_close(lp[0, 1], torch.tensor([LOG_ZERO, math.log(0.1), math.log(0.25)]))


@pytest.mark.parametrize("granularity", ["sequence", "token"])
def test_separate_form_is_eq10_on_the_chosen_temperatures(granularity):
    log_pi, index, first, _ = one_pair()
    beta = 2.0
    loss, margin = lpo_loss("separate", beta, log_pi, index, granularity, first)
    m = math.log(0.8) - math.log(0.7)
    assert float(margin) == pytest.approx(m, rel=1e-5)
    assert float(loss.detach()) == pytest.approx(nll_sigmoid(beta * m), rel=1e-5)
    loss.backward()
    g = -beta * (
        1.0 - 1.0 / (1.0 + math.exp(-beta * m))
    )  # d loss / d log P(tau_c); the opposite for tau_r
    assert float(log_pi.grad[0, 0, 0]) == pytest.approx(g, rel=1e-5)
    assert float(log_pi.grad[1, 0, 1]) == pytest.approx(-g, rel=1e-5)
    assert float(log_pi.grad.abs().sum()) == pytest.approx(
        2 * abs(g), rel=1e-5
    )  # nothing else moves


def test_token_form_sums_over_generated_positions():
    log_pi = torch.log(
        torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.5, 0.5]], [[0.5, 0.5], [0.4, 0.6], [0.5, 0.5]]])
    )
    index = torch.tensor([[0, 0, -1], [1, 1, -1]])  # two generated tokens per row
    loss, margin = lpo_loss("separate", 1.0, log_pi, index, "token", torch.tensor([0, 0]))
    m = (math.log(0.5) + math.log(0.9)) - (math.log(0.5) + math.log(0.6))
    assert float(margin) == pytest.approx(m, rel=1e-5)
    assert float(loss) == pytest.approx(nll_sigmoid(m), rel=1e-5)


def test_joint_form_adds_the_frozen_token_likelihood_ratio():
    log_pi, index, first, token_lp = one_pair()
    loss, margin = lpo_loss("joint", 1.0, log_pi, index, "token", first, token_lp)
    # pi = log P(y | tau) + log P(tau); ref = log of the uniform mixture 0.5 p_0.5(y) + 0.5 p_1(y)
    chosen = math.log(0.9 * 0.8) - math.log(0.5 * 0.9 + 0.5 * 0.75)
    rejected = math.log(0.25 * 0.7) - math.log(0.5 * 0.1 + 0.5 * 0.25)
    assert float(margin) == pytest.approx(chosen - rejected, rel=1e-5)
    assert float(loss) == pytest.approx(nll_sigmoid(chosen - rejected), rel=1e-5)


def test_latent_form_marginalises_the_temperature():
    log_pi, index, first, token_lp = one_pair()
    loss, margin = lpo_loss("latent", 1.0, log_pi, index, "token", first, token_lp)
    chosen = math.log(0.8 * 0.9 + 0.2 * 0.75) - math.log(0.825)
    rejected = math.log(0.3 * 0.1 + 0.7 * 0.25) - math.log(0.175)
    assert float(margin) == pytest.approx(chosen - rejected, rel=1e-5)
    assert float(loss) == pytest.approx(nll_sigmoid(chosen - rejected), rel=1e-5)
    ref = torch.log(torch.tensor([0.6, 0.4])).expand(2, 2, 2)  # a non-uniform reference policy
    _, margin_ref = lpo_loss("latent", 1.0, log_pi, index, "token", first, token_lp, ref)
    expect = (math.log(0.87) - math.log(0.6 * 0.9 + 0.4 * 0.75)) - (
        math.log(0.205) - math.log(0.6 * 0.1 + 0.4 * 0.25)
    )
    assert float(margin_ref) == pytest.approx(expect, rel=1e-5)


def test_sequence_mixture_multiplies_token_likelihoods_per_temperature():
    log_pi = torch.log(torch.tensor([[[0.25, 0.75], [0.5, 0.5], [0.5, 0.5]]]))
    token_lp = torch.log(torch.tensor([[[0.5, 0.2], [0.4, 0.1], [1.0, 1.0]]]))
    mask = torch.tensor([[True, True, False]])
    got = mixture_log_likelihood(log_pi, token_lp, mask, "sequence", torch.tensor([0]))
    assert float(got) == pytest.approx(math.log(0.25 * 0.5 * 0.4 + 0.75 * 0.2 * 0.1), rel=1e-5)


def test_bad_form_beta_and_missing_logits_are_named():
    log_pi, index, first, _ = one_pair()
    with pytest.raises(ValueError, match="unknown LPO loss form 'dpo'"):
        lpo_loss("dpo", 1.0, log_pi, index, "token", first)
    with pytest.raises(ValueError, match="beta must be > 0"):
        lpo_loss("separate", 0.0, log_pi, index, "token", first)
    with pytest.raises(ValueError, match="needs the target's logits"):
        lpo_loss("latent", 1.0, log_pi, index, "token", first)
