"""Kangaroo proposer: drafts with the target's own first layers + the adapter, reusing their KV in
verification.

Drafting (one chain per step). The root and each drafted token go through the target's layers
``0..exit_layer-1`` (:meth:`LeanDecoder.forward_layers`) on the TARGET's KV cache, at the slot the
token will occupy when verified (``prefix + depth``); the adapter (its own small cache) and the
target's LM head then draft the next token. After token d is drafted, the adapter's output for it is
computed and the stop policy sees ``StopContext(d, q(token d), adapter state)``: the default,
:class:`ConfidenceStop` with the export's threshold, stops once the draft's top-1 probability falls
below it (Kangaroo's second early exit; the unconfident token is still verified). A SpecDec++ or any
other policy from the loop replaces it.

Verification reuses the shallow work (Kangaroo's ``in_features_large``) through
:class:`~draftsmith.runtime.drafting.kangaroo_reuse.KangarooTarget` (runtime/drafting/
kangaroo_reuse.py): verifying the chain just drafted runs only the deep layers. A loop that does not
run the wrapper still works: the proposer then keeps the shallow layers' K/V in a private cache of
those layers only and every verification is a full forward (no reuse).

Losslessness: the target's KV for every verified token equals a full forward's (same layers, same
slots, same inputs), so greedy decoding is token-identical; drafts are point masses (greedy) or
record their q (sampled), so rejection sampling is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from draftsmith.common.errors import InputError
from draftsmith.drafters.kangaroo import KangarooDrafter, check_exit_layer
from draftsmith.runtime.acceptance.stop_policies import ConfidenceStop, StopContext
from draftsmith.runtime.acceptance.verifiers import on_generator_device, target_probs
from draftsmith.runtime.drafting.base import Proposer, StepContext
from draftsmith.runtime.drafting.kangaroo_reuse import KangarooTarget, ShallowDraft
from draftsmith.runtime.drafting.registry import register_chain, register_proposer
from draftsmith.runtime.drafting.tree import DraftTree
from draftsmith.runtime.target.interface import (
    RuntimeCache,
    TargetDecoder,
)


class KangarooProposer(Proposer):
    """Self-speculative chain drafting (see the module docstring). ``target`` must offer the
    layer-range API."""

    # accept() never reads the target's logits: greedy verify may take argmaxes only
    reads_logits = False

    def __init__(
        self,
        target: TargetDecoder,
        drafter: KangarooDrafter,
        threshold: float = 0.6,
        max_depth: int = 6,
        temperature: float = 0.0,
        top_p: float = 1.0,
    ) -> None:
        if not (isinstance(target, TargetDecoder) and target.layer_range):
            raise InputError(
                "Kangaroo drafts with the target's own first layers on its KV cache: it needs the"
                f" lean decoder (layer-range forward), not {type(target).__name__}; use --backend"
                " lean"
            )
        if not 0.0 < float(threshold) < 1.0:
            raise InputError(
                f"kangaroo threshold {threshold} is outside (0, 1): it is the draft's top-1"
                " probability below which drafting stops (the paper: 0.6)"
            )
        if max_depth < 1 or temperature < 0 or not 0 < top_p <= 1:
            raise InputError(
                f"need max_depth >= 1, temperature >= 0 and 0 < top_p <= 1; got {max_depth}, "
                f"{temperature}, {top_p}"
            )
        self.num_layers = target.sizes.num_layers
        self.exit_layer = check_exit_layer(drafter.config.exit_layer, self.num_layers)
        self.target, self.drafter = target, drafter.eval()
        self.threshold, self.max_depth = float(threshold), int(max_depth)
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.default_policy = ConfidenceStop(self.threshold, self.max_depth)
        self.feature_taps = (
            self.exit_layer,
        )  # the loop hands over the shallow states of prompt and accepted rows
        self.max_tree_nodes = self.max_depth + 1
        # the target's KV cache, bound by KangarooTarget.allocate_cache
        self.cache: RuntimeCache | None = None
        # True: not bound, drafting on a cache of the shallow layers only (no reuse)
        self.private = False
        self.acache = None  # the adapter's cache: committed entries (one per token before the root)
        self.committed = 0
        self._spec: tuple[Any, int] = (None, 0)  # (adapter cache after drafting, entries it added)
        self.pending: ShallowDraft | None = None

    def wrap_target(self, model: TargetDecoder) -> KangarooTarget:
        """The decoder the speculative loop must run for shallow-cache reuse (and to share its cache
        with us)."""
        return KangarooTarget(model, self)

    def shallow_layers(self) -> Sequence[torch.nn.Module]:
        """The target's first ``exit_layer`` layers: the drafter's sub-network, the same objects and
        storage."""
        return self.target.layer_weights(0, self.exit_layer)

    # ---- events ----------------------------------------------------------------------------------
    def begin(self, ctx: StepContext) -> None:
        """New generation: the prompt's shallow states (taps [P, H]) fill the adapter's cache.
        Without a bound target cache (a loop not running :meth:`wrap_target`), the shallow layers'
        K/V of the prompt go to a private cache of those layers only: drafting then works the same
        but verification is a full forward.
        """
        self.acache, self.committed, self.pending = None, 0, None
        if self.cache is None or self.private:
            self._private_prefill(ctx.tokens[:-1])
        self._feed(self._taps(ctx))

    @torch.no_grad()
    def _private_prefill(self, prompt: torch.Tensor) -> None:
        if self.cache is None or self.cache.max_len < prompt.numel() + self.max_tree_nodes + 1:
            size = max(
                self.target.sizes.context_length or 0, prompt.numel() + self.max_tree_nodes + 1
            )
            self.cache = self.target.allocate_layer_cache(self.exit_layer, size)
        self.private, self.cache.length = True, 0
        x = self.target.embed_tokens(prompt.to(self.target.device))  # [P, H]
        self.target.forward_layers(x, self.cache, 0, self.exit_layer)
        self.cache.commit(prompt.numel())

    def accept(self, ctx: StepContext) -> None:
        """Keep the adapter entries of the accepted tokens (root first); compute any the draft did
        not reach."""
        keep = ctx.acceptance.num_accepted + 1
        spec, made = self._spec
        if spec is not None and made > 0:
            self.acache = spec.crop(self.committed + min(keep, made))
            self.committed += min(keep, made)
        if keep > made:
            self._feed(self._taps(ctx)[made:keep])
        # the loop commits its own cache; ours holds root + accepted tokens' shallow K/V
        if self.private:
            self.cache.commit(keep)
        self._spec, self.pending = (None, 0), None

    def _taps(self, ctx: StepContext) -> torch.Tensor:
        if ctx.taps is None:
            raise ValueError(
                f"the Kangaroo proposer needs the target's layer-{self.exit_layer} taps; run it in"
                " a SpeculativeDecoder over proposer.wrap_target(model)"
            )
        return ctx.taps

    @torch.no_grad()
    def _feed(self, states: torch.Tensor) -> None:
        """Append adapter entries for committed tokens' shallow states [m, H]."""
        if states.shape[0]:
            _, self.acache = self.drafter(
                states[None].to(self.drafter.lm_head_weight.dtype), past_kv=self.acache
            )
            self.committed += states.shape[0]

    # ---- drafting --------------------------------------------------------------------------------
    def _shallow(self, token: int, slot: int) -> torch.Tensor:
        """The shallow state [1, H] of ``token`` at cache slot ``slot`` (its shallow K/V written
        there)."""
        cache, length = self.cache, self.cache.length
        # forward_layers writes at cache.length and attends to every slot before it
        cache.length = slot
        try:
            x = self.target.embed_tokens(torch.tensor([token], device=self.target.device))
            return self.target.forward_layers(x, cache, 0, self.exit_layer)  # [1, H]
        finally:
            cache.length = length

    @torch.no_grad()
    def propose(self, ctx: StepContext) -> DraftTree:
        """Draft a chain from ``ctx.root_token`` until the stop policy (default: top-1 prob <
        threshold) says so."""
        if self.cache is None:
            raise RuntimeError(
                "the Kangaroo proposer has no KV cache: call begin() at the start of a generation "
                "(SpeculativeDecoder does)"
            )
        prefix = self.cache.length
        if self.committed != prefix or prefix != ctx.tokens.numel() - 1:
            raise RuntimeError(
                f"Kangaroo proposer out of sync: {self.committed} adapter entries, {prefix} cached "
                f"tokens, context of {ctx.tokens.numel() - 1}; call begin() per generation"
            )
        policy = ctx.stop_policy or self.default_policy
        levels = min(self.max_depth, policy.max_depth)
        tokens, confs, qs, states = [ctx.root_token], [1.0], [], []
        acache, made, stop = self.acache, 0, StopContext(0, 1.0)
        for d in range(levels + 1):
            states.append(self._shallow(tokens[-1], prefix + d))
            if d == levels:
                break
            h, acache = self.drafter(
                states[-1][None].to(self.drafter.lm_head_weight.dtype), past_kv=acache
            )
            made += 1
            if d > 0:  # the policy sees token d with the adapter state whose input is token d
                stop = stop.child(d, confs[-1], h[0, -1])
                if policy.should_stop(stop):
                    break
            logits = self.target.lm_head_logits(h[0, -1]).float()  # [V]
            token, conf, q = self._pick(logits, ctx.generator)
            tokens.append(token)
            confs.append(conf)
            if q is not None:
                qs.append(q)
        self._spec = (acache, made)
        self.pending = ShallowDraft(torch.tensor(tokens), torch.cat(states), prefix)
        return DraftTree.drawn_chain(tokens, qs, confs)

    def _pick(
        self, logits: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[int, float, torch.Tensor | None]:
        """(token, its draft probability, q over the vocabulary when sampled)."""
        if self.temperature == 0:
            p = torch.softmax(logits, -1)
            token = int(p.argmax())
            return token, float(p[token]), None
        q = on_generator_device(target_probs(logits, self.temperature, self.top_p), generator)
        token = int(torch.multinomial(q, 1, generator=generator))
        return token, float(q[token]), q.double().cpu()


@register_chain("kangaroo")
def _kangaroo_chain(tokens: int) -> dict[str, Any]:
    """Kangaroo always drafts a chain: ``max_depth`` counts drafted tokens."""
    return {"max_depth": tokens}


@register_proposer("kangaroo")
def _build_kangaroo(
    export_dir: str | Path, config: dict, target_model: TargetDecoder, **options: Any
) -> KangarooProposer:
    """Kangaroo proposer; options: threshold, max_depth, temperature, top_p (defaults from the
    export's inference). The speculative loop must run ``proposer.wrap_target(model)`` to share the
    cache and reuse shallow states.
    """
    valid = {"threshold", "max_depth", "temperature", "top_p"}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise InputError(
            f"unknown option(s) {unknown} for the kangaroo proposer; valid: {sorted(valid)}"
        )
    if not (isinstance(target_model, TargetDecoder) and target_model.layer_range):
        raise InputError(
            "Kangaroo drafts with the target's own first layers on its KV cache: it needs the lean "
            f"decoder (layer-range forward), not {type(target_model).__name__}; use --backend lean"
        )
    exit_layer = check_exit_layer(
        config["architecture"]["exit_layer"], target_model.sizes.num_layers
    )
    w = target_model.lm_head_weight
    shallow = target_model.layer_weights(0, exit_layer)
    drafter, _ = KangarooDrafter.from_export(export_dir, lm_head_weight=w, shallow_layers=shallow)
    drafter = drafter.to(device=w.device, dtype=w.dtype).eval()
    inference = config.get("inference") or {}
    kw = {"threshold": inference.get("threshold", 0.6), "max_depth": inference.get("max_depth", 6)}
    kw.update({k: v for k, v in options.items() if v is not None})
    return KangarooProposer(target_model, drafter, **kw)
