"""The EAGLE-1 / EAGLE-3 proposer: feeds target features to a drafter with its own KV cache and
drafts a chain, or an EAGLE-2 dynamic tree (runtime/drafting/eagle_tree.py).

Feature feeding follows the pairing of drafters/eagle.py's module docstring (pair ``t`` = target
feature of token ``t`` with token ``t+1``, at RoPE position ``t``; EAGLE-3 fuses its
``target_layers`` taps with its ``fc``). The proposer keeps the pairs whose features came from the
target in the drafter's cache (``num_committed`` of them) and the features not yet paired as
``pending``: ``begin`` stores the prompt's features (paired with the prompt's next tokens),
``accept`` those of the accepted path's nodes (paired with the accepted tokens); the last pending
feature pairs with the root token, known in ``propose``. ``propose`` crops the cache back to the
committed pairs (dropping last step's speculative entries), runs the pending pairs in one forward
(the "root step": its last output drafts depth 1), then drafts:

- ``policy="chain"``: ``depth + 1`` tokens, one drafter forward each, greedy (point masses) or, with
  ``temperature > 0``, sampled from q = softmax(logits / temperature) within ``top_p``; q is
  recorded in the DraftTree (over the target vocabulary) so the rejection sampler stays exact.
- ``policy="tree"`` (EAGLE-2): the root step's top-k are the depth-1 nodes, expanded ``depth``
  times a frontier of k nodes at a time and reranked (runtime/drafting/eagle_tree.py).

In both policies the longest drafted path has ``depth + 1`` tokens (EAGLE-2's convention); a stop
policy lowers that to its ``max_depth`` and leaves a node without children when ``should_stop`` says
so for the node's :class:`~draftsmith.runtime.acceptance.stop_policies.StopContext` (its depth, its
draft probability, its drafter output as ``state``). EAGLE-3 drafts over its reduced vocabulary; ids
are mapped to target ids with ``d2t`` and sampled-chain q is scattered onto the target vocabulary
(zero outside the draft vocabulary).

Why this is lossless under rejection sampling: a top-k child is a point mass, accepted with p(x) and
otherwise zeroed out of p; that is exact for any child chosen without looking at the verifier's
coins (see acceptance/rejection_sampling.py). A sampled chain records the q its token was drawn
from: min(1, p/q) and norm(max(0, p - q)) apply."""

from __future__ import annotations

from typing import Any

import torch

from draftsmith.common.constants import EAGLE_CHAIN_PROPOSER, EAGLE_TREE_PROPOSER
from draftsmith.common.errors import InputError
from draftsmith.common.layers import KVCache
from draftsmith.runtime.acceptance.stop_policies import StopContext
from draftsmith.runtime.acceptance.verifiers import on_generator_device, target_probs
from draftsmith.runtime.drafting.base import Proposer, StepContext
from draftsmith.runtime.drafting.eagle_models import DraftModel
from draftsmith.runtime.drafting.eagle_ops import torch_topk
from draftsmith.runtime.drafting.eagle_tree import draft_dynamic_tree
from draftsmith.runtime.drafting.tree import DraftTree

POLICIES = {
    "tree": "tree",
    "chain": "chain",
    EAGLE_TREE_PROPOSER: "tree",
    EAGLE_CHAIN_PROPOSER: "chain",
}


class EagleProposer(Proposer):
    """Drafts with an EAGLE drafter (see the module docstring for the policies and how features are
    fed)."""

    shape_family = (  # runtime/shapes/draft_shapes.py: chains and trees through reshape()
        "dynamic_tree"
    )
    # accept() reads hidden states and taps: greedy verify may skip the [N, V] logits
    reads_logits = False
    # every _draft() is one drafter forward (its native path enters no nn.Module)
    counts_draft_calls = True

    def __init__(
        self,
        model: DraftModel,
        policy: str = "tree",
        total_tokens: int = 16,
        depth: int = 4,
        top_k: int = 4,
        temperature: float = 0.0,
        top_p: float = 1.0,
    ) -> None:
        if policy not in POLICIES:
            raise InputError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
        self.policy = POLICIES[policy]
        draft_vocab = model.vocab_size if model.draft_ids is None else int(model.draft_ids.numel())
        if depth < 0 or not 1 <= top_k <= draft_vocab or total_tokens < 1:
            raise InputError(
                f"need depth >= 0, 1 <= top_k <= {draft_vocab} (draft vocabulary) and total_tokens"
                f" >= 1; got depth={depth}, top_k={top_k}, total_tokens={total_tokens}"
            )
        if temperature < 0 or not 0 < top_p <= 1:
            raise InputError(
                f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}"
            )
        if self.policy == "tree" and temperature > 0:
            raise InputError(
                "dynamic trees draft the top-k children (point masses, exact under rejection"
                " sampling); temperature > 0 is for policy='chain'"
            )
        self.model, self.shape_vocab = model, draft_vocab
        self.feature_taps = tuple(model.feature_taps)
        self.total_tokens, self.depth, self.top_k = total_tokens, depth, top_k
        self.temperature, self.top_p = temperature, top_p
        self.max_tree_nodes = total_tokens if self.policy == "tree" else depth + 2
        # the drafter's: committed pairs, then this step's speculative entries
        self.cache: KVCache | None = None
        self.num_committed = 0  # pairs built from target features (positions 0 .. num_committed-1)
        self.pending_feats: torch.Tensor | None = None  # [m, F] target features not yet fed
        self.pending_ids: list[
            int
        ] = []  # [m-1] the token after each but the last (a list: one tensor per step)

    def reshape(self, options: dict[str, Any]) -> None:
        """Draft another shape from now on: ``policy``, ``total_tokens``, ``top_k``, ``depth``
        (checked as in ``__init__``); the drafter, its cache and the sampling settings are kept."""
        kw = {
            "policy": self.policy,
            "total_tokens": self.total_tokens,
            "depth": self.depth,
            "top_k": self.top_k,
        }
        kw.update(options)
        probe = EagleProposer.__new__(EagleProposer)
        EagleProposer.__init__(
            probe, self.model, temperature=self.temperature, top_p=self.top_p, **kw
        )
        self.policy, self.total_tokens, self.depth, self.top_k = (
            probe.policy,
            probe.total_tokens,
            probe.depth,
            probe.top_k,
        )
        self.max_tree_nodes = probe.max_tree_nodes

    # ---- feature feeding -------------------------------------------------------------------------
    def begin(self, ctx: StepContext) -> None:
        """New generation: forget the drafter cache; the prompt's features pair with the prompt's
        next tokens."""
        self.cache, self.num_committed = None, 0
        self._set_pending(
            ctx.tokens[1:-1].tolist(), ctx
        )  # tokens = prompt + root: the prompt's next tokens

    def accept(self, ctx: StepContext) -> None:
        """The accepted nodes' features [a+1, F] (root first) pair with the accepted tokens, then
        the bonus token."""
        self._set_pending(list(ctx.acceptance.accepted_tokens), ctx)

    def _set_pending(self, next_ids: list[int], ctx: StepContext) -> None:
        feats = ctx.taps if self.feature_taps else ctx.hidden
        if self.feature_taps and ctx.taps is None and ctx.hidden.numel():
            raise ValueError(
                f"this drafter needs the target's layer taps {list(self.feature_taps)}; run it with"
                " a SpeculativeDecoder, which requests them from the target forward"
            )
        self.pending_feats = feats  # [m, F]
        self.pending_ids = next_ids  # [m-1]: the token after each feature but the last

    def _root_step(
        self, ctx: StepContext, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, KVCache]:
        """Run the pending pairs (the last one with the root token): -> (out [1, 1, H], head, ids,
        cache), the head as in :meth:`_draft` (top-``k`` log-probs [k] and draft ids [k], or logits
        [N] and None when k = 0).
        """
        feats = self.pending_feats
        m = 0 if feats is None else feats.shape[0]
        if m == 0 or len(self.pending_ids) != m - 1:
            raise RuntimeError(
                "EagleProposer has no target features to draft from: call begin() at the start of a"
                " generation and accept() after every verified tree (SpeculativeDecoder does)"
            )
        if self.num_committed + m != ctx.tokens.numel() - 1:
            raise RuntimeError(
                f"EagleProposer is out of sync with the decoding loop: {self.num_committed + m} "
                f"tokens fed for a context of {ctx.tokens.numel() - 1}; call begin() per generation"
            )
        ids = torch.tensor([[*self.pending_ids, ctx.root_token]], device=feats.device)  # [1, m]
        cache = None if self.cache is None else self.cache.crop(self.num_committed)
        out, head, top, cache = self._draft(
            self.model.features(feats), ids, cache, None, None, True, k
        )
        self.cache, self.num_committed = (
            cache,
            self.num_committed + m,
        )  # committed: pairs from target features only
        self.pending_feats, self.pending_ids = None, []  # fed: the next accept() brings new ones
        return out[:, -1:], head[-1], None if top is None else top[-1], cache

    def _draft(
        self,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        cache: KVCache | None,
        positions: torch.Tensor | None,
        mask: torch.Tensor | None,
        last_only: bool,
        k: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, KVCache]:
        """One drafter forward -> (out [1, S, H], log-probs [S', k] fp32, draft ids [S', k], cache),
        descending; k = 0: (out, logits [S', N], None, cache) for sampling. The model's
        ``step_topk`` (the fused head: no [S', N] logits) when it has one, else its logits through
        log_softmax + top-k."""
        self.draft_calls += 1
        if k and self.model.step_topk is not None:
            return self.model.step_topk(hidden, ids, cache, positions, mask, last_only, k)
        out, logits, cache = self.model.step(hidden, ids, cache, positions, mask, last_only)
        return (out, logits[0], None, cache) if k == 0 else (out, *torch_topk(logits[0], k), cache)

    @property
    def draft_plan(self) -> dict[str, str]:
        """Which parts of a draft call run natively, and why the others do not (for the runtime's
        report)."""
        return dict(self.model.native_plan)

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        ids = self.model.draft_ids
        return draft_ids if ids is None else ids.to(draft_ids.device)[draft_ids]

    # ---- drafting --------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, ctx: StepContext) -> DraftTree:
        """Draft a chain or a dynamic tree rooted at ``ctx.root_token``."""
        k = (0 if self.temperature > 0 else 1) if self.policy == "chain" else self.top_k
        out, head, top, cache = self._root_step(ctx, k)
        policy = ctx.stop_policy
        levels = self.depth + 1 if policy is None else min(self.depth + 1, policy.max_depth)
        if self.policy == "chain":
            return (
                self._chain(ctx, out, (head, top), cache, levels)
                if levels >= 1
                else DraftTree.chain([ctx.root_token])
            )
        if levels < 1 or self.total_tokens < 2:
            return DraftTree.chain([ctx.root_token])
        return draft_dynamic_tree(self, ctx, out, (head, top), cache, levels)

    def _chain(
        self,
        ctx: StepContext,
        out: torch.Tensor,
        head: tuple[torch.Tensor, torch.Tensor | None],
        cache: KVCache,
        levels: int,
    ) -> DraftTree:
        """``head``: the root step's (logits [N], None) when sampling, else (log-prob [1], draft id
        [1]) of its top."""
        tokens, confs, qs, stop = [ctx.root_token], [1.0], [], StopContext(0, 1.0)
        sampling = self.temperature > 0
        for d in range(1, levels + 1):
            if sampling:
                logits = head[0]  # [N]
                q = on_generator_device(
                    target_probs(logits.float(), self.temperature, self.top_p), ctx.generator
                )
                x = torch.multinomial(q, 1, generator=ctx.generator)  # [1] draft id
                qs.append(self._on_target_vocab(q))
                confs.append(float(q[x]))
            else:  # greedy: the head's top-1 (its probability is only the confidence)
                x = head[1].reshape(1)  # [1] draft id
                confs.append(float(head[0].reshape(-1)[0].exp()))
            token = self._to_target(x.to(out.device))  # [1] target id
            tokens.append(int(token))
            if d == levels:
                break
            # The new node pairs its parent's drafter output with its token, at the next position.
            out, step_head, step_top, cache = self._draft(
                out, token[None], cache, None, None, True, int(not sampling)
            )
            head = (step_head[-1], None if step_top is None else step_top[-1])
            # As in trees, the stop policy sees the node's own drafter output (the state its child
            # is drafted from).
            stop = stop.child(d, confs[-1], out[0, -1])
            if ctx.stop_policy is not None and ctx.stop_policy.should_stop(stop):
                break
        if qs:  # row i: the law node i's child was drawn from; the leaf has none
            draft_q = torch.stack(qs + [torch.zeros_like(qs[0])])  # [N, V]
            tree = DraftTree.chain(tokens, draft_q, "with_replacement")
        else:
            tree = DraftTree.chain(tokens)
        tree.draft_confidence = torch.tensor(confs)
        return tree

    def _on_target_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """A draft-vocab distribution [N] as one over the target vocabulary [V] (float64, CPU)."""
        q = q.double().cpu()
        if self.model.draft_ids is None:
            return q
        return torch.zeros(self.model.vocab_size, dtype=torch.float64).index_copy_(
            0, self.model.draft_ids.cpu(), q
        )
