"""Latent Preference Optimization losses (arXiv 2411.09661): three forms of its preference loss,
described below.

Every form is a DPO logistic loss ``-log sigmoid(beta * [(pi_c - ref_c) - (pi_r - ref_r)])`` on a
chosen (c) and a rejected (r) response of the same prompt; they differ in what ``pi`` and ``ref``
are:

- ``separate`` (the paper's Eq. 10, default): ``pi = log P_phi(tau)``, the head's log-probability of
  the recorded temperature indices (one index for ``sequence``, summed over generated positions for
  ``token``); no reference.
- ``joint`` (temperatures as tokens): ``pi = log P(y | tau) + log P_phi(tau)``, ``ref = log
  P_ref(y)`` (the reference decoder's marginal likelihood of the response). With a frozen target
  ``log P(y | tau)`` and ``ref`` do not depend on phi: they shift each pair's operating point on the
  logistic (its weight), not the direction of the update.
- ``latent`` (temperatures as latents): ``pi = log P'_phi(y)`` with ``P'(y) = sum_tau P_phi(tau) P(y
  | tau)`` (per position for ``token``, over the whole response for ``sequence``) and ``ref = log
  P'_ref(y)``.

``P(y_t | tau)`` is ``softmax(logits_t / tau)[y_t]``; at ``tau = 0`` it is the greedy point mass (1
at the argmax, 0 elsewhere: log 0 is kept as a large negative number so sums and log-sum-exps stay
finite).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

LOSS_FORMS = ("separate", "joint", "latent")
LOG_ZERO = -1.0e4  # log-probability of a token a greedy (tau = 0) step could not have emitted


def dpo_loss(
    pi_c: torch.Tensor,
    pi_r: torch.Tensor,
    beta: float,
    ref_c: torch.Tensor | float = 0.0,
    ref_r: torch.Tensor | float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean loss, margins [B])`` of ``-log sigmoid(beta * margin)``, ``margin = (pi_c - ref_c) -
    (pi_r - ref_r)``."""
    if beta <= 0:
        raise ValueError(f"LPO's beta must be > 0, got {beta}")
    margin = (pi_c - ref_c) - (pi_r - ref_r)  # [B]
    return -F.logsigmoid(beta * margin).mean(), margin.detach()


def choice_log_prob(log_probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Summed ``log P_phi(tau_t)`` [B] of the recorded indices ``index`` [B, T] (-1 = no choice at
    that position) under the head's ``log_probs`` [B, T, K]."""
    picked = log_probs.gather(-1, index.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, T]
    return (picked * (index >= 0)).sum(-1)


def tempered_token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, grid: Sequence[float]
) -> torch.Tensor:
    """``log softmax(logits / tau_k)[token]`` for every grid temperature: logits [B, T, V], tokens
    [B, T] -> [B, T, K].

    One temperature at a time so that only [B, T] values per temperature are kept (never [B, T, K,
    V]).
    """
    x = logits.float()
    out = []
    for tau in grid:
        if tau == 0:
            hit = x.argmax(-1) == tokens  # [B, T]
            out.append(torch.where(hit, 0.0, LOG_ZERO).to(x.dtype))
        else:
            # [B, T]
            lp = torch.log_softmax(x / tau, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            out.append(lp.clamp(min=LOG_ZERO))
    return torch.stack(out, dim=-1)  # [B, T, K]


def recorded_token_log_prob(token_lp: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log P(y | tau)`` [B]: the token log-probabilities [B, T, K] at each position's recorded
    index [B, T]."""
    picked = token_lp.gather(-1, index.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, T]
    return (picked * (index >= 0)).sum(-1)


def mixture_log_likelihood(
    log_pi: torch.Tensor,
    token_lp: torch.Tensor,
    mask: torch.Tensor,
    granularity: str,
    first: torch.Tensor | None = None,
) -> torch.Tensor:
    """``log P'(y)`` [B] of the responses under the temperature mixture.

    ``log_pi`` [B, T, K]: the head's (or reference's) log-probabilities at every position;
    ``token_lp`` [B, T, K] from :func:`tempered_token_log_probs`; ``mask`` [B, T] marks the
    positions that generated a response token.
    ``token``: ``sum_t mask_t logsumexp_k(log_pi[t, k] + token_lp[t, k])``.
    ``sequence``: ``logsumexp_k(log_pi[first, k] + sum_t mask_t token_lp[t, k])`` with ``first`` [B]
    the prompt's last position (where the sequence-level choice is made).
    """
    m = mask.to(token_lp.dtype)
    if granularity == "token":
        return (torch.logsumexp(log_pi + token_lp, dim=-1) * m).sum(-1)
    if first is None:
        raise ValueError(
            "the sequence-level mixture needs the position of each prompt's last token"
        )
    rows = torch.arange(log_pi.shape[0], device=log_pi.device)
    per_k = (token_lp * m.unsqueeze(-1)).sum(1)  # [B, K]
    return torch.logsumexp(log_pi[rows, first] + per_k, dim=-1)


def lpo_loss(
    form: str,
    beta: float,
    log_pi: torch.Tensor,
    index: torch.Tensor,
    granularity: str,
    first: torch.Tensor,
    token_lp: torch.Tensor | None = None,
    ref_log_pi: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LPO loss of one batch of pairs -> ``(loss, margins [P])``.

    Rows are ``[chosen_0..chosen_{P-1}, rejected_0..rejected_{P-1}]``. ``log_pi`` [2P, T, K] head
    log-probabilities, ``index`` [2P, T] recorded temperature indices at the positions that
    generated a token (-1 elsewhere), ``first`` [2P] the prompt's last position. ``token_lp`` [2P,
    T, K] (:func:`tempered_token_log_probs`) and ``ref_log_pi`` (the reference policy's
    log-probabilities, same shape as ``log_pi``; uniform when None) are needed by the joint and
    latent forms only.
    """
    if form not in LOSS_FORMS:
        raise ValueError(f"unknown LPO loss form {form!r}; choose one of {', '.join(LOSS_FORMS)}")
    pairs = log_pi.shape[0] // 2
    rows = torch.arange(log_pi.shape[0], device=log_pi.device)
    if granularity == "sequence":
        tau_lp = (
            log_pi[rows, first].gather(-1, index[rows, first].clamp(min=0)[:, None]).squeeze(-1)
        )  # [2P]
    else:
        tau_lp = choice_log_prob(log_pi, index)  # [2P]
    if form == "separate":
        return dpo_loss(tau_lp[:pairs], tau_lp[pairs:], beta)
    if token_lp is None:
        raise ValueError(f"the {form} LPO form needs the target's logits (token log-probabilities)")
    if ref_log_pi is None:
        ref_log_pi = torch.full_like(
            log_pi, -torch.log(torch.tensor(float(log_pi.shape[-1]))).item()
        )
    mask = index >= 0
    ref = mixture_log_likelihood(ref_log_pi, token_lp, mask, granularity, first)  # [2P]
    if form == "joint":
        pi = recorded_token_log_prob(token_lp, index) + tau_lp  # [2P]
    else:
        pi = mixture_log_likelihood(log_pi, token_lp, mask, granularity, first)  # [2P]
    return dpo_loss(pi[:pairs], pi[pairs:], beta, ref[:pairs], ref[pairs:])
