"""Adaptive-temperature recipe: the controller of controllers/adaptive_temperature.py trained with
LPO on the chosen/rejected pairs of a rollout folder.

``python train.py recipe=adaptive_temperature data=ROLLOUT_DIR controller.granularity=sequence|token
[lpo.form=separate|joint|latent] [lpo.reference=uniform|EXPORT]``

The loop (rounds), each round on the same target:
1. ``draftsmith rollouts --out r1 --granularity token`` (no controller: uniformly random grid
   temperatures);
2. ``python train.py recipe=adaptive_temperature data=r1`` -> ``outputs/.../export``;
3. ``draftsmith rollouts --controller R1_EXPORT --out r2`` (samples with the trained head), then
   ``python train.py recipe=adaptive_temperature data=r1+r2 controller.init=R1_EXPORT``: the pairs
   of every round so far, starting from the last round's head (optionally
   ``lpo.reference=R1_EXPORT`` for the joint / latent forms), and so on.
The grid comes from the rollout folder (``controller.grid`` may repeat it, never change it: the
recorded indices point into it).
"""

from __future__ import annotations

from typing import Any

import torch

from draftsmith.common.errors import ConfigError
from draftsmith.controllers.adaptive_temperature import (
    METHOD,
    AdaptiveTemperatureConfig,
    AdaptiveTemperatureHead,
    check_grid,
)
from draftsmith.distill.data.preferences import read_pair_rounds
from draftsmith.distill.engine.objective import Objective
from draftsmith.distill.losses.lpo import lpo_loss, tempered_token_log_probs
from draftsmith.distill.target.frozen import FeatureTaps, Target
from draftsmith.export.format import ExportError
from draftsmith.recipes.adaptive_temperature import AdaptiveTemperature


class AdaptiveTemperatureObjective(Objective):
    """LPO on the head's log-probabilities of the recorded temperature indices (and, for the joint /
    latent forms, on the frozen target's token log-probabilities at every grid temperature)."""

    batch_kind = "preference"

    def __init__(
        self,
        module: AdaptiveTemperatureHead,
        form: str,
        beta: float,
        reference: AdaptiveTemperatureHead | None = None,
    ) -> None:
        self.module, self.form, self.beta = module, form, beta
        self.taps = FeatureTaps(final_hidden=True, logits=form != "separate")
        self.frozen = {"reference": reference} if reference is not None else {}

    def features(self, target: Any, batch: dict[str, torch.Tensor]) -> Any:
        """The target's features of the batch. Sequence level with the separate form reads only each
        prompt's last hidden state: then only the prompts are forwarded, once per pair (a chosen and
        its rejected row share the prompt; causal attention makes the cut exact), about 4x fewer
        target tokens."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if self.module.config.granularity == "sequence" and self.form == "separate":
            pairs, width = ids.shape[0] // 2, int(batch["first"].max()) + 1
            feats = target.features(ids[:pairs, :width], mask[:pairs, :width], self.taps)
            feats.final_hidden = feats.final_hidden.repeat(2, 1, 1)  # [P, W, H] -> [2P, W, H]
            return feats
        return target.features(ids, mask, self.taps)

    def loss(
        self, batch: dict[str, torch.Tensor], feats: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """LPO loss; metrics: pair accuracy (margin > 0), the margin, and the head's expected
        temperature at the prompt's last position per prompt kind (``temp_kind<i>``, kinds in the
        order of the rollout meta).
        """
        cfg = self.module.config
        log_pi = self.module.log_probs(feats.final_hidden)  # [2P, T, K]
        index, first = batch["choice_index"], batch["first"]
        token_lp = ref = None
        if self.form != "separate":
            tokens = torch.roll(
                batch["input_ids"], -1, dims=1
            )  # [2P, T] token t + 1, sampled from position t
            token_lp = tempered_token_log_probs(feats.logits, tokens, cfg.grid)  # [2P, T, K]
            if "reference" in self.frozen:
                with torch.no_grad():
                    ref = self.frozen["reference"].log_probs(feats.final_hidden)  # [2P, T, K]
        loss, margin = lpo_loss(
            self.form, self.beta, log_pi, index, cfg.granularity, first, token_lp, ref
        )
        with torch.no_grad():
            rows = torch.arange(len(first), device=first.device)
            expected = (log_pi[rows, first].exp() * self.module.grid.to(log_pi.device)).sum(
                -1
            )  # [2P]
            metrics = {"pair_acc": (margin > 0).float().mean(), "margin": margin.mean()}
            for k in batch["kind"].unique().tolist():
                metrics[f"temp_kind{k}"] = expected[batch["kind"] == k].mean()
        return loss, metrics

    def export_config(self) -> dict[str, Any]:
        inference = {
            "granularity": self.module.config.granularity,
            "choice": "greedy",
            "verifier": "rejection",
            "grid": list(self.module.config.grid),
        }
        return {
            "method": METHOD,
            "architecture": self.module.architecture(),
            "inference": inference,
        }


def _grid(cfg: AdaptiveTemperature, meta: dict[str, Any]) -> list[float]:
    data_grid = list(check_grid(meta["grid"]))
    asked = cfg.controller.grid
    if asked is not None:
        try:
            asked = list(check_grid(asked))
        except ValueError as err:
            raise ConfigError(f"controller.grid: {err}") from None
        if asked != data_grid:
            raise ConfigError(
                f"controller.grid {asked} differs from the grid the rollouts were sampled on "
                f"{data_grid}; drop controller.grid (it is read from the rollout folder)"
            )
    return data_grid


def validate(cfg: AdaptiveTemperature) -> None:
    """Before the target loads: the rollout folder reads (a broken one fails fast) and fits the
    controller's grid and granularity."""
    meta, _ = read_pair_rounds(cfg.data.spec)
    _grid(cfg, meta)
    if cfg.controller.granularity == "sequence" and meta.get("granularity") == "token":
        raise ConfigError(
            "controller.granularity=sequence cannot learn from token-level rollouts (each response "
            "mixes temperatures); sample rollouts with --granularity sequence"
        )


def build(cfg: AdaptiveTemperature, target: Target) -> AdaptiveTemperatureObjective:
    """A head on the target's post-norm hidden state over the rollout folder's temperature grid."""
    meta, _ = read_pair_rounds(cfg.data.spec)
    hidden = int(target.model.config.hidden_size)
    c = cfg.controller
    arch = AdaptiveTemperatureConfig(
        hidden_size=hidden,
        grid=_grid(cfg, meta),
        granularity=c.granularity,
        width=c.width,
        num_layers=c.num_layers,
    )
    reference = None
    ref_spec = cfg.lpo.reference or "uniform"
    if ref_spec != "uniform":
        try:
            reference, _ = AdaptiveTemperatureHead.from_export(ref_spec)
        except ExportError as err:
            raise ConfigError(f"lpo.reference: {err}") from None
        if list(reference.config.grid) != arch.grid or reference.config.hidden_size != hidden:
            raise ConfigError(
                f"lpo.reference {ref_spec} was trained on another grid or target (grid "
                f"{reference.config.grid}, hidden {reference.config.hidden_size})"
            )
    head = AdaptiveTemperatureHead(arch)
    if c.init:
        head = _previous_round(c.init, head).train()
    return AdaptiveTemperatureObjective(head, cfg.lpo.form, cfg.lpo.beta, reference)


def _previous_round(export: str, head: AdaptiveTemperatureHead) -> AdaptiveTemperatureHead:
    """The head of ``controller.init`` (a previous round's export), which must have ``head``'s
    architecture."""
    try:
        previous, _ = AdaptiveTemperatureHead.from_export(export)
    except ExportError as err:
        raise ConfigError(f"controller.init: {err}") from None
    theirs, ours = previous.architecture(), head.architecture()
    differ = sorted(k for k in ours if theirs.get(k) != ours[k])
    if differ:
        raise ConfigError(
            f"controller.init {export} has another {', '.join(differ)}"
            f" ({', '.join(f'{k}={theirs.get(k)!r} vs {ours[k]!r}' for k in differ)}); start from"
            " an export of the same architecture, or drop controller.init"
        )
    return previous
