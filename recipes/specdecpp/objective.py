"""SpecDec++ recipe: an acceptance-prediction head on a frozen chain drafter (EAGLE-1, EAGLE-3
chain, Kangaroo).

``python train.py recipe=specdecpp drafter=EXPORT_DIR``. For every context position t of a
(target-generated, e.g. ``draftsmith regenerate``) conversation the frozen drafter reads the
target's pairs up to t (teacher forcing, as at inference where the committed pairs come from the
target) and drafts a candidate Z for token t+2 from its distribution q (temperature
``head.temperature``; 0 = argmax). A second drafter pass feeds (its own output, Z) at position t+1,
seeing the target pairs 0..t and itself: that output is the state the runtime's chain proposer hands
the stop policy for Z, and what the head reads. Label: the probability that speculative sampling
accepts Z, ``min(1, p(Z) / q(Z))`` with p the target's distribution at t+1 (temperature 0: ``[Z ==
argmax p]``).

Kangaroo base: the drafter reads the target's shallow states, so the paper's scheme applies
directly: candidates Z drafted at every position replace the tokens they draft, a second target
forward gives the shallow states of that sequence of draft tokens, and the adapter's output at the
position whose input is Z is the state (as at inference, the context then holds earlier drafted
tokens).

Mixing (``head.mixing_ratio``, the paper's r = 0.15): that share of candidates is the target's own
next token instead of a draft sample; like the paper, those positions carry no label unless
``head.mixed_in_loss`` (then labelled ``min(1, p(x)/q(x))``); with a Kangaroo base they are also the
target-generated tokens in the drafted context.
Loss: weighted soft BCE with ``head.reject_weight`` on the reject class.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from draftsmith.common.constants import STOP_LEARNED
from draftsmith.common.errors import ConfigError, DataError
from draftsmith.controllers.acceptance import (
    METHOD,
    AcceptanceHead,
    AcceptanceHeadConfig,
    binary_kl,
    weighted_soft_bce,
)
from draftsmith.distill.engine.objective import Objective
from draftsmith.distill.target.frozen import FeatureTaps, Target
from draftsmith.drafters.eagle import EagleDrafter
from draftsmith.drafters.eagle3 import Eagle3Drafter
from draftsmith.drafters.kangaroo import KangarooDrafter
from draftsmith.export.format import ExportError, read_config
from draftsmith.export.stacking import base_reference
from draftsmith.export.target_check import check_target
from draftsmith.recipes.specdecpp import SpecDecPP

CHAIN_DRAFTERS = {cls.method: cls for cls in (EagleDrafter, Eagle3Drafter, KangarooDrafter)}
BASE_METHODS = tuple(CHAIN_DRAFTERS)


@dataclass
class HeadBatch:
    """What the frozen drafter produced for one batch: the head's inputs and labels on scored
    rows."""

    states: torch.Tensor  # [M, H] drafter state of each candidate
    labels: torch.Tensor  # [M] soft accept labels
    weight: torch.Tensor  # [M] 1 = in the loss (mixed candidates may be 0)


def _min_ratio(p_z: torch.Tensor, q_z: torch.Tensor) -> torch.Tensor:
    """``min(1, p/q)`` in log space (q > 0 for a token drawn from q)."""
    return torch.exp(
        torch.clamp(
            p_z.double().clamp_min(1e-300).log() - q_z.double().clamp_min(1e-300).log(), max=0.0
        )
    ).float()


class SpecDecObjective(Objective):
    """Trains :class:`AcceptanceHead` on the states of a frozen chain drafter (see the module
    docstring)."""

    def __init__(
        self,
        head: AcceptanceHead,
        drafter: torch.nn.Module,
        base_method: str,
        base_ref: dict[str, Any],
        reject_weight: float,
        temperature: float,
        mixing_ratio: float,
        mixed_in_loss: bool,
        inference: dict[str, Any],
    ) -> None:
        self.module = head
        self.frozen = {"drafter": drafter}  # moved with the target, never optimised, never saved
        self.drafter = drafter.eval().requires_grad_(False)
        self.base_method, self.base_ref = base_method, base_ref
        self.reject_weight, self.temperature = reject_weight, temperature
        self.mixing_ratio, self.mixed_in_loss = mixing_ratio, mixed_in_loss
        self.inference = inference
        layers = tuple(drafter.tapped_layers)
        self.taps = FeatureTaps(final_hidden=not layers, layers=layers, logits=True)

    # ---- the frozen drafter's two passes ---------------------------------------------------------
    def _pass(
        self,
        features: torch.Tensor,
        ids: torch.Tensor,
        cache: Any,
        positions: torch.Tensor | None,
        tree_mask: torch.Tensor | None,
        pad: torch.Tensor,
    ) -> tuple[torch.Tensor, Any]:
        """One drafter forward over pairs (features [B, N, F|H], ids [B, N]) -> (out [B, N, H],
        cache)."""
        if self.base_method == "eagle":
            return self.drafter(
                ids,
                features,
                attention_mask=pad,
                past_kv=cache,
                positions=positions,
                tree_mask=tree_mask,
            )
        # taps fused only for target pairs
        hidden = self.drafter.fuse(features) if cache is None else features
        out, _, cache = self.drafter.draft_step(hidden, ids, cache, positions, pad, tree_mask)
        return out, cache

    def _draft_probs(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafter outputs [M, H] -> (q over the draft vocabulary [M, N], target id of each draft id
        or None)."""
        logits = self.drafter.logits(out).float()  # [M, N]
        q = (
            F.softmax(logits / self.temperature, -1)
            if self.temperature > 0
            else F.softmax(logits, -1)
        )
        ids = None if self.base_method == "eagle" else self.drafter.draft_ids_in_target()
        return q, ids

    def _candidates(
        self, q: torch.Tensor, d2t: torch.Tensor | None, truth: torch.Tensor, p_all: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft q [M, N] -> (candidate target ids [M], labels [M], mixed [M] bool): sampled (or
        argmax) drafts, a ``mixing_ratio`` share replaced by the target's token ``truth``, labelled
        against p_all [M, V] logits.
        """
        # [M] draft ids
        draft = torch.multinomial(q, 1).squeeze(-1) if self.temperature > 0 else q.argmax(-1)
        z = draft if d2t is None else d2t.to(draft.device)[draft]  # [M] target ids
        mixed = torch.rand(z.shape, device=z.device) < self.mixing_ratio
        z = torch.where(mixed, truth, z)
        if self.temperature == 0:
            return (
                z,
                (z == p_all.argmax(-1)).float(),
                mixed,
            )  # greedy verification accepts exactly the argmax
        p_z = F.softmax(p_all / self.temperature, -1).gather(-1, z[:, None]).squeeze(-1)
        dz = z
        if d2t is not None:  # target id -> draft id (-1: outside the draft vocabulary, q = 0)
            t2d = torch.full((p_all.shape[-1],), -1, dtype=torch.long, device=z.device)
            t2d[d2t.to(z.device)] = torch.arange(d2t.numel(), device=z.device)
            dz = t2d[z]
        q_z = torch.where(
            dz >= 0, q.gather(-1, dz.clamp_min(0)[:, None]).squeeze(-1), torch.zeros_like(p_z)
        )
        return z, _min_ratio(p_z, q_z), mixed

    @torch.no_grad()
    def _self_drafting_features(self, target: Any, batch: dict[str, torch.Tensor]) -> HeadBatch:
        """A self-drafting base (``drafter.self_drafting``, Kangaroo): the candidates replace the
        tokens they draft (the paper's sequence of draft tokens, a ``mixing_ratio`` share kept as
        the target's); a second target forward gives their shallow states, whose adapter outputs the
        head reads (as at inference, the context holds earlier drafted tokens)."""
        ids, attn = batch["input_ids"], batch["attention_mask"]
        n, layer = ids.shape[1] - 1, self.drafter.config.exit_layer  # row t drafts token t+1
        feats = target.features(ids, attn, self.taps)
        h0, _ = self.drafter(
            feats.layer_hidden[layer][:, :n], attention_mask=attn[:, :n]
        )  # [B, N, H]
        keep = (batch["loss_mask"][:, 1:] * attn[:, 1:]).bool()  # [B, N]
        logits = self.drafter.logits(h0[keep]).float()  # [M, V]
        q = (
            F.softmax(logits / self.temperature, -1)
            if self.temperature > 0
            else F.softmax(logits, -1)
        )
        z, labels, mixed = self._candidates(
            q, None, ids[:, 1:][keep], feats.logits[:, :n][keep].float()
        )
        seq = ids.clone()
        seq[:, 1:][keep] = z  # [B, T]
        shallow = target.features(
            seq, attn, FeatureTaps(final_hidden=False, layers=(layer,))
        ).layer_hidden[layer]
        h1, _ = self.drafter(shallow, attention_mask=attn)  # [B, T, H]
        weight = torch.ones_like(labels) if self.mixed_in_loss else (~mixed).float()
        return HeadBatch(h1[:, 1:][keep].float(), labels, weight)

    @torch.no_grad()
    def features(self, target: Any, batch: dict[str, torch.Tensor]) -> HeadBatch:
        """Target forward, then the drafter's candidate pass and state pass; labels from the
        target's logits."""
        if self.drafter.self_drafting:
            return self._self_drafting_features(target, batch)
        ids, attn = batch["input_ids"], batch["attention_mask"]
        n = ids.shape[1] - 2  # index t: pair (f_t, x_{t+1}) drafts x_{t+2}
        if n < 1:
            raise DataError(f"SpecDec++ needs sequences of at least 3 tokens, got {ids.shape[1]}")
        feats = target.features(ids, attn, self.taps)
        tf = (
            feats.final_hidden
            if self.base_method == "eagle"
            else torch.cat([feats.layer_hidden[i] for i in self.drafter.config.target_layers], -1)
        )  # [B, T, F]
        pad = attn[:, :n] * attn[:, 1 : n + 1]  # [B, N] both f_t and x_{t+1} real
        out0, cache = self._pass(tf[:, :n], ids[:, 1 : n + 1], None, None, None, pad)  # [B, N, H]
        keep = (
            batch["loss_mask"][:, 2:] * attn[:, 2:]
        ).bool()  # [B, N] candidate for an assistant token
        q, d2t = self._draft_probs(out0[keep])  # [M, N]
        z, labels, mixed = self._candidates(
            q, d2t, ids[:, 2:][keep], feats.logits[:, 1 : n + 1][keep].float()
        )
        # State pass: index t feeds (out0_t, Z_{t+2}) at position t+1, seeing target pairs 0..t and
        # itself.
        cand = torch.zeros_like(ids[:, :n])
        cand[keep] = z
        causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
        tree = torch.cat([causal, torch.eye(n, dtype=torch.bool, device=ids.device)], 1)  # [N, 2N]
        positions = torch.arange(1, n + 1, device=ids.device).expand(ids.shape[0], n)  # [B, N]
        state, _ = self._pass(
            out0, cand, cache, positions, tree, torch.cat([pad, keep.to(pad.dtype)], 1)
        )
        weight = torch.ones_like(labels) if self.mixed_in_loss else (~mixed).float()
        return HeadBatch(state[keep].float(), labels, weight)

    def loss(
        self, batch: dict[str, torch.Tensor], feats: HeadBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Weighted soft BCE; metrics: binary KL, mean label, mean predicted acceptance."""
        logit = self.module(feats.states)  # [M] rejection logits
        loss = weighted_soft_bce(logit, feats.labels, self.reject_weight, feats.weight)
        with torch.no_grad():
            pred = torch.sigmoid(-logit)
            w = feats.weight
            metrics = {
                "binary_kl": binary_kl(feats.labels, pred, w),
                "label_accept": (feats.labels * w).sum() / w.sum().clamp_min(1),
                "pred_accept": (pred * w).sum() / w.sum().clamp_min(1),
            }
        return loss, metrics

    def export_config(self) -> dict[str, Any]:
        arch = {
            **self.module.architecture(),
            "base_method": self.base_method,
            "base_export": self.base_ref,
        }
        return {
            "method": METHOD,
            "architecture": arch,
            "inference": dict(self.inference),
            "base_export": self.base_ref,
        }


def load_frozen_drafter(export_dir: str | Path, target: Any) -> tuple[torch.nn.Module, str]:
    """The chain drafter of ``export_dir`` on the target's frozen embedding / LM head -> (drafter,
    method)."""
    try:
        config = read_config(export_dir)
    except ExportError as err:
        raise ConfigError(f"drafter={export_dir}: {err}") from None
    method = config.get("method")
    if method not in BASE_METHODS:
        raise ConfigError(
            f"drafter={export_dir} is a {method!r} export; SpecDec++ trains on a chain drafter: "
            f"{', '.join(BASE_METHODS)}"
        )
    check_target(config, target.identity(), getattr(target, "name_or_path", None))
    drafter, _ = CHAIN_DRAFTERS[method].from_export_on(export_dir, target)
    return drafter.float(), method


def validate(cfg: SpecDecPP) -> None:
    """Before the target loads: ``drafter`` names a chain drafter's export, and the stop rule's
    depths are ordered."""
    if not cfg.drafter:
        raise ConfigError(
            "recipe=specdecpp trains on an existing chain drafter: pass drafter=EXPORT_DIR "
            f"(an export of {' or '.join(BASE_METHODS)})"
        )
    try:
        method = read_config(cfg.drafter).get("method")
    except ExportError as err:
        raise ConfigError(f"drafter={cfg.drafter}: {err}") from None
    if method not in BASE_METHODS:
        raise ConfigError(
            f"drafter={cfg.drafter} is a {method!r} export; SpecDec++ trains on a chain drafter: "
            f"{', '.join(BASE_METHODS)}"
        )
    stop = cfg.inference
    if stop.min_depth > stop.max_depth:
        raise ConfigError(
            f"need 1 <= inference.min_depth <= inference.max_depth, got {stop.min_depth}, "
            f"{stop.max_depth}"
        )


def build(cfg: SpecDecPP, target: Target) -> SpecDecObjective:
    """The head sized from the drafter's hidden size; the drafter export is loaded frozen and
    referenced."""
    drafter, method = load_frozen_drafter(cfg.drafter, target)
    h, stop = cfg.head, cfg.inference
    head = AcceptanceHead(AcceptanceHeadConfig(drafter.config.hidden_size, h.num_layers))
    inference = {
        "proposer": "chain",
        "verifier": stop.verifier,
        "stop_policy": {
            "kind": STOP_LEARNED,
            "threshold": stop.threshold,
            "min_depth": stop.min_depth,
            "max_depth": stop.max_depth,
        },
    }
    return SpecDecObjective(
        head,
        drafter,
        method,
        base_reference(cfg.drafter),
        h.reject_weight,
        h.temperature,
        h.mixing_ratio,
        h.mixed_in_loss,
        inference,
    )
