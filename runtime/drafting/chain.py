"""Chain and sampled-tree proposers over any small decoder drafter (the generic drafting
families)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from draftsmith.common.errors import InputError
from draftsmith.runtime.acceptance.stop_policies import StopContext
from draftsmith.runtime.acceptance.verifiers import on_generator_device, target_probs
from draftsmith.runtime.drafting.base import Proposer, StepContext
from draftsmith.runtime.drafting.tree import DraftTree
from draftsmith.runtime.target.interface import RuntimeCache, TargetDecoder


class ChainProposer(Proposer):
    """A chain of ``depth`` tokens from a next-token drafter (a tree with one path).

    ``drafter(token_ids [L]) -> logits [V]`` for the token after ``token_ids`` (e.g.
    :class:`DecoderDrafter` over a small LM). ``temperature == 0`` drafts greedily (point masses);
    otherwise it samples from softmax(logits / temperature) within ``top_p`` and records q for the
    rejection sampler.
    """

    # accept() never reads the target's logits: greedy verify may take argmaxes only
    reads_logits = False

    def __init__(
        self,
        drafter: Callable[[torch.Tensor], torch.Tensor],
        depth: int = 4,
        temperature: float = 0.0,
        top_p: float = 1.0,
    ) -> None:
        if depth < 1:
            raise InputError(f"chain depth must be >= 1, got {depth}")
        self.drafter = drafter
        self.depth = depth
        self.temperature = temperature
        self.top_p = top_p
        self.max_tree_nodes = depth + 1

    @property
    def draft_depth(self) -> int:  # type: ignore[override]
        """The chain's length: the deepest depth-only shape the shape search may cut it to."""
        return self.depth

    def begin(self, ctx: StepContext) -> None:
        """Stateless: the drafter sees the full token sequence each call."""

    @torch.no_grad()
    def propose(self, ctx: StepContext) -> DraftTree:
        """Draft up to ``depth`` tokens (fewer if the stop policy says so)."""
        seq = ctx.tokens
        tokens, qs, confs = [ctx.root_token], [], [1.0]
        policy, stop = ctx.stop_policy, StopContext(0, 1.0)
        max_depth = min(self.depth, policy.max_depth) if policy is not None else self.depth
        while len(tokens) - 1 < max_depth:
            logits = on_generator_device(self.drafter(seq).float(), ctx.generator)  # [V]
            if self.temperature > 0:
                q = target_probs(logits, self.temperature, self.top_p)  # [V] float64
                x = int(torch.multinomial(q, 1, generator=ctx.generator))
            else:
                q = torch.softmax(logits.double(), -1)
                x = int(q.argmax())
            qs.append(q.cpu())
            tokens.append(x)
            confs.append(float(q[x]))
            seq = torch.cat([seq, seq.new_tensor([x])])
            stop = stop.child(len(tokens) - 1, confs[-1])
            if policy is not None and policy.should_stop(stop):
                break
        if self.temperature > 0:
            draft_q = torch.stack(
                qs + [torch.zeros_like(qs[0])]
            )  # [N, V]; the leaf has no children
            tree = DraftTree.chain(tokens, draft_q, "with_replacement")
        else:
            tree = DraftTree.chain(tokens)
        tree.draft_confidence = torch.tensor(confs)
        return tree

    def accept(self, ctx: StepContext) -> None:
        """Stateless."""


class SampledTreeProposer(Proposer):
    """A tree from a next-token drafter: node at depth d gets ``branching[d]`` children
    (EAGLE-1-style sampling tree).

    ``temperature > 0``: children drawn from q = softmax(logits / temperature) within ``top_p``,
    i.i.d. (``replacement=True``, duplicates allowed) or one after another without replacement; q is
    recorded for the rejection sampler; without replacement a node gets fewer children when the
    ``top_p`` nucleus holds fewer tokens. ``temperature == 0``: the top-``branching[d]`` tokens
    (point masses, EAGLE-2-style top-k). A stop policy can leave a node unexpanded.
    """

    # accept() never reads the target's logits: greedy verify may take argmaxes only
    reads_logits = False

    def __init__(
        self,
        drafter: Callable[[torch.Tensor], torch.Tensor],
        branching: tuple[int, ...] = (2, 2),
        temperature: float = 1.0,
        top_p: float = 1.0,
        replacement: bool = True,
    ) -> None:
        if not branching or min(branching) < 1:
            raise ValueError(
                f"branching must be a non-empty sequence of positive ints, got {branching}"
            )
        self.drafter = drafter
        self.branching = tuple(int(b) for b in branching)
        self.temperature = temperature
        self.top_p = top_p
        self.replacement = replacement
        width, total = 1, 1
        for b in self.branching:
            width *= b
            total += width
        self.max_tree_nodes = total

    def begin(self, ctx: StepContext) -> None:
        """Stateless."""

    @torch.no_grad()
    def propose(self, ctx: StepContext) -> DraftTree:
        """Expand nodes breadth-first (parents always precede children)."""
        tokens, parents, depths, confs, seqs = [ctx.root_token], [-1], [0], [1.0], [ctx.tokens]
        qs: list[torch.Tensor | None] = [None]
        stops = [StopContext(0, 1.0)]  # one per node: each path keeps its own policy scratch
        policy = ctx.stop_policy
        i = 0
        while i < len(tokens):
            d = depths[i]
            stop = d >= len(self.branching) or (
                policy is not None
                and (d >= policy.max_depth or (d > 0 and policy.should_stop(stops[i])))
            )
            if not stop:
                logits = on_generator_device(self.drafter(seqs[i]).float(), ctx.generator)  # [V]
                k = self.branching[d]
                if self.temperature > 0:
                    q = target_probs(logits, self.temperature, self.top_p)  # [V] float64
                    if not self.replacement:
                        # Without replacement a nucleus of n < k tokens yields n children: torch
                        # would either fail or return zero-probability tokens. n depends on q only,
                        # never on the verifier's coins, so the rejection sampler stays exact (it
                        # then draws from the residual).
                        k = min(k, int(torch.count_nonzero(q)))
                    kids = torch.multinomial(
                        q, k, replacement=self.replacement, generator=ctx.generator
                    )  # [k]
                else:
                    q = torch.softmax(logits.double(), -1)
                    kids = q.topk(k).indices
                qs[i] = q.cpu()
                for x in kids.tolist():
                    tokens.append(x)
                    parents.append(i)
                    depths.append(d + 1)
                    confs.append(float(q[x]))
                    stops.append(stops[i].child(d + 1, float(q[x])))
                    seqs.append(torch.cat([seqs[i], seqs[i].new_tensor([x])]))
                    qs.append(None)
            i += 1
        if self.temperature > 0:
            vocab = (
                next(q for q in qs if q is not None).numel()
                if any(q is not None for q in qs)
                else 1
            )
            draft_q = torch.stack(
                [q if q is not None else torch.zeros(vocab, dtype=torch.float64) for q in qs]
            )
            mode = "with_replacement" if self.replacement else "without_replacement"
            return DraftTree.from_parents(tokens, parents, draft_q, mode, torch.tensor(confs))
        return DraftTree.from_parents(tokens, parents, draft_confidence=torch.tensor(confs))

    def accept(self, ctx: StepContext) -> None:
        """Stateless."""


class DecoderDrafter:
    """Next-token drafter over a decoder with the runtime interface (``allocate_cache``,
    ``forward``).

    Keeps its own KV cache and reuses the longest common prefix between calls, so a chain costs one
    token-forward per drafted token plus the tokens accepted since the last call.
    """

    def __init__(self, model: TargetDecoder, max_len: int = 2048) -> None:
        self.model = model
        self.max_len = max_len
        self.cache: RuntimeCache | None = None
        self.ids = torch.empty(0, dtype=torch.long)

    @torch.no_grad()
    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits [V] of the token after ``token_ids`` [L]."""
        if token_ids.numel() == 0:
            raise ValueError("the drafter needs at least one token")
        if token_ids.numel() > self.max_len:
            raise ValueError(
                f"{token_ids.numel()} tokens exceed the drafter's cache ({self.max_len}); raise"
                " max_len"
            )
        if self.cache is None:
            self.cache = self.model.allocate_cache(self.max_len)
        ids = token_ids.cpu()
        n = min(
            self.cache.length, ids.numel() - 1
        )  # always feed at least the last token to get its logits
        same = (self.ids[:n] == ids[:n]).long()
        lcp = int(same.cumprod(0).sum()) if n > 0 else 0
        self.cache.length = lcp  # roll back to the common prefix
        new = token_ids[lcp:]
        logits = self.model.forward(
            new.to(self.model.device), self.cache, logits_for="last"
        ).logits  # [1, V]
        self.cache.commit(new.numel())
        self.ids = ids.clone()
        return logits[-1]
