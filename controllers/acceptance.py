"""SpecDec++ acceptance-prediction head, its labels and its loss.

The head reads the chain drafter's hidden state at the position whose INPUT is a drafted token (the
state the drafter drafts that token's successor from) and predicts the probability that the token is
REJECTED given that every token before it on the chain was accepted. It outputs one rejection logit,
the convention of :class:`draftsmith.runtime.acceptance.stop_policies.LearnedStop` (stop iff ``1 -
prod(1 - sigmoid(logit_i)) > h``).

Layout: ``num_layers`` independent ResBlocks (``x + SiLU(W x + b)``), built with a comprehension so
that "3 layers" means three blocks with their own weights (the reference code multiplies a one-block
list, sharing one block n times), then ``Linear(h, 1)``.

Labels (SpecDec++ section 6.3): for a token Z drafted from q at a context where the target's
distribution is p, the probability that speculative sampling accepts it is ``min(1, p(Z) / q(Z))``;
a greedy (point-mass) draft is accepted with ``p(Z)`` at temperature > 0 and with ``[Z == argmax
p]`` at temperature 0.
Loss (section 6.4): weighted soft BCE, the reject class weighted by ``reject_weight`` (the paper's
``weight_mismatch`` = 6), normalised by the total weight of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.export.exportable import Exportable, ExportContents
from draftsmith.export.format import ExportError
from draftsmith.export.stacking import resolve_base_export

METHOD = "specdecpp"


@dataclass
class AcceptanceHeadConfig:
    """Architecture of the head: the drafter's hidden size and the number of independent
    ResBlocks."""

    hidden_size: int
    num_layers: int = 3

    def __post_init__(self) -> None:
        if self.hidden_size < 1 or self.num_layers < 0:
            raise ValueError(
                f"need hidden_size >= 1 and num_layers >= 0, got {self.hidden_size},"
                f" {self.num_layers}"
            )


class ResBlock(nn.Module):
    """``x + SiLU(Linear(x))`` (SpecDec++ does not zero-initialise it, unlike Medusa)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class AcceptanceHead(Exportable, nn.Module):
    """Drafter state [..., H] -> rejection logit [...] (sigmoid = P(this draft token is
    rejected))."""

    method = METHOD
    config_class = AcceptanceHeadConfig
    extra_architecture_keys = True  # the architecture block also keeps base_export

    def __init__(self, config: AcceptanceHeadConfig) -> None:
        super().__init__()
        self.config = config
        # One block per layer, each with its own weights (a multiplied list would share one
        # block's).
        self.blocks = nn.Sequential(
            *[ResBlock(config.hidden_size) for _ in range(config.num_layers)]
        )
        self.out = nn.Linear(config.hidden_size, 1)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        x = state.to(self.out.weight.dtype)
        return self.out(self.blocks(x)).squeeze(-1)  # [..., H] -> [...]

    def accept_prob(self, state: torch.Tensor) -> torch.Tensor:
        """P(accept) [...] = 1 - sigmoid(rejection logit)."""
        return torch.sigmoid(-self(state))

    @classmethod
    def _build(
        cls,
        architecture: AcceptanceHeadConfig,
        export: ExportContents,
        base_dir: str | Path | None = None,
    ) -> AcceptanceHead:
        """The head of a SpecDec++ export, after checking the drafter export it was trained on.

        ``base_dir`` overrides the recorded drafter location; the drafter found there must be the
        very export the head was trained on (config and weights fingerprint), else ExportError. The
        returned export config's ``base_export.path`` is then the folder found (see
        :func:`base_export_dir`).
        """
        stacked = stacked_config(export.config)
        base = resolve_base_export(stacked, base_dir)
        if base is None:
            raise ExportError(
                f"{export.path}: a {METHOD} export must record the drafter export it was trained on"
                " (base_export); re-export it"
            )
        export.config["base_export"] = {**stacked["base_export"], "path": str(base)}
        return cls(architecture)


def base_export_dir(config: dict[str, Any]) -> Path:
    """The drafter export folder of a SpecDec++ export config returned by
    ``AcceptanceHead.from_export`` (resolved and fingerprint-checked there)."""
    return Path(stacked_config(config)["base_export"]["path"])


def stacked_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config with its ``base_export`` block, which a head export also keeps under
    ``architecture`` (the trainer's export writer copies only method / architecture / target /
    inference / training)."""
    if config.get("base_export"):
        return config
    return {**config, "base_export": (config.get("architecture") or {}).get("base_export")}


def acceptance_labels(
    p_target: torch.Tensor, q_draft: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """``min(1, p(Z) / q(Z))`` [...]: the probability that speculative sampling accepts the drafted
    token Z.

    p_target, q_draft [..., V] probabilities over the same vocabulary; tokens [...] the drafted ids
    (drawn from q, so q(Z) > 0). Computed in log space, as the reference does: ``exp(min(0, log p -
    log q))``.
    """
    z = tokens.unsqueeze(-1)
    log_p = p_target.gather(-1, z).squeeze(-1).double().clamp_min(1e-300).log()
    log_q = q_draft.gather(-1, z).squeeze(-1).double().clamp_min(1e-300).log()
    return torch.exp(torch.clamp(log_p - log_q, max=0.0)).to(p_target.dtype)


def weighted_soft_bce(
    reject_logit: torch.Tensor,
    accept_prob: torch.Tensor,
    reject_weight: float = 6.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """SpecDec++'s weighted soft BCE over valid positions.

    ``sum(w * (1-p) * CE(reject) + p * CE(accept)) / (w * sum(1-p) + sum(p))`` with ``p`` the soft
    accept label, ``CE(reject) = -log sigmoid(z)`` and ``CE(accept) = -log(1 - sigmoid(z))`` for the
    rejection logit ``z``.
    """
    if mask is None:
        mask = torch.ones_like(accept_prob)
    mask = mask.to(reject_logit.dtype)
    p = accept_prob.to(reject_logit.dtype) * mask
    not_p = (1 - accept_prob.to(reject_logit.dtype)) * mask
    ce_reject, ce_accept = F.softplus(-reject_logit), F.softplus(reject_logit)
    total = (reject_weight * not_p * ce_reject + p * ce_accept).sum()
    return total / (reject_weight * not_p.sum() + p.sum()).clamp_min(1e-8)


def binary_kl(
    accept_prob: torch.Tensor, predicted_accept: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean KL(Bernoulli(label) || Bernoulli(prediction)) over valid positions (the paper's logged
    metric)."""
    eps = 1e-6
    p = accept_prob.double().clamp(eps, 1 - eps)
    r = predicted_accept.double().clamp(eps, 1 - eps)
    kl = p * (p / r).log() + (1 - p) * ((1 - p) / (1 - r)).log()
    if mask is None:
        return kl.mean().float()
    m = mask.double()
    return ((kl * m).sum() / m.sum().clamp_min(1)).float()
