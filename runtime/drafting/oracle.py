"""The oracle proposer: a chain that drafts the target's own greedy continuation, each position
right with a chosen probability given that the previous one was right, so the speculative loop's
ceiling at any acceptance is measured.

It is not an export method (there is nothing to load), so no registry builds it: the bench
(:mod:`draftsmith.bench.oracle`) builds it directly and hands it the plain greedy continuation of
every prompt, decoded beforehand. Greedy speculative decoding emits exactly the plain greedy tokens
(in fp32; in bf16 a verify block can flip a near-tie, see :attr:`OracleProposer.diverged`), so the
continuation after the tokens emitted so far is known before drafting. Everything after drafting
(verify, acceptance, KV commit) is the runtime's own loop.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import torch

from draftsmith.common.errors import InputError
from draftsmith.runtime.drafting.base import Proposer, StepContext
from draftsmith.runtime.drafting.tree import DraftTree


def check_oracle(acceptance: float, chain: int, draft_ms: float = 0.0) -> None:
    """Refuse, in one line, an acceptance outside [0, 1], a chain below 1 or a negative draft
    cost."""
    if not 0.0 <= float(acceptance) <= 1.0:  # also refuses NaN
        raise InputError(
            f"--oracle-acceptance is a probability: it must be in [0, 1], got {acceptance}"
        )
    if int(chain) != chain or chain < 1:
        raise InputError(
            f"--oracle-chain is the number of drafted tokens: it must be >= 1, got {chain}"
        )
    if not float(draft_ms) >= 0.0:
        raise InputError(
            f"--oracle-draft-ms is a simulated cost per draft call: it must be >= 0, got {draft_ms}"
        )


def expected_tau(acceptance: float, chain: int) -> float:
    """Tokens a step emits on average: sum_{i=0..K} p^i (i accepted drafts need i right positions in
    a row; the target's bonus token is the i = 0 term)."""
    return sum(acceptance**i for i in range(chain + 1))


def wrong_token(right: int) -> int:
    """A fixed id that is never ``right`` (the greedy token), inside any vocabulary of two or more
    ids."""
    return right - 1 if right > 0 else 1


def spin_wait(ms: float) -> None:
    """Busy-wait ``ms`` milliseconds: a drafter's cost occupies the core it runs on, which sleeping
    would not."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


class OracleProposer(Proposer):
    """Drafts ``chain`` tokens a step from the reference continuation of the prompt being decoded:
    position j is the greedy token with probability ``acceptance`` when positions 1..j-1 were,
    otherwise :func:`wrong_token` (and so is every later position: the verifier stops at the first
    wrong one anyway). The chain is always full, so each verify forward has the shape a real chain
    drafter's would.

    ``references``: prompt ids -> the target's greedy continuation of that prompt (the first
    generated token first), ideally ``chain`` tokens longer than the generation so the last step
    drafts known tokens too. ``seed``: each generation draws from its own RNG seeded by the seed and
    the prompt's place in ``references``, so a prompt's draws repeat from run to run (and from a
    rehearsal to the timed pass). ``draft_ms``: a simulated drafting cost, spin-waited once per
    draft call. A proposer of this kind declares no ``feature_taps`` and never reads logits.
    """

    # accept() never reads the target's logits: greedy verify may take argmaxes only
    reads_logits = False

    def __init__(
        self,
        references: dict[tuple[int, ...], Sequence[int]],
        acceptance: float,
        chain: int,
        draft_ms: float = 0.0,
        seed: int = 0,
    ) -> None:
        check_oracle(acceptance, chain, draft_ms)
        self.acceptance, self.chain, self.draft_ms, self.seed = (
            float(acceptance),
            int(chain),
            float(draft_ms),
            seed,
        )
        self.max_tree_nodes = self.chain + 1
        self.draft_depth = (
            self.chain
        )  # one chain shape, never reshaped (shape_family stays "depth")
        self.counts_draft_calls, self.draft_calls = (
            True,
            0,
        )  # one simulated draft call per step, counted in propose()
        self.references: dict[tuple[int, ...], torch.Tensor] = {}
        for prompt, continuation in references.items():
            self.set_reference(prompt, continuation)
        # generations whose emitted tokens left their reference (a bf16 near-tie flipped)
        self.diverged = 0
        self._reference = torch.empty(
            0, dtype=torch.long
        )  # [R] continuation of the prompt being decoded
        self._prompt_len = 0
        self._on_track = False
        self._rng = random.Random(seed)

    def set_reference(self, prompt: Sequence[int], continuation: Sequence[int]) -> None:
        """Give (or replace) the greedy continuation of ``prompt``; a new prompt takes the next RNG
        stream."""
        self.references[tuple(int(t) for t in prompt)] = torch.tensor(
            [int(t) for t in continuation], dtype=torch.long
        )  # [R]

    def begin(self, ctx: StepContext) -> None:
        """Find the prompt's reference (ValueError when it has none) and seed its RNG stream."""
        prompt = tuple(ctx.tokens[:-1].tolist())
        if prompt not in self.references:
            raise ValueError(
                f"the oracle has no greedy reference for this {len(prompt)}-token prompt: decode it"
                " plainly first and pass it in references"
            )
        self._reference = self.references[prompt]
        self._prompt_len = len(prompt)
        self._rng = random.Random(self.seed * 1_000_003 + list(self.references).index(prompt))
        self._on_track = self._reference.numel() > 0 and int(self._reference[0]) == ctx.root_token
        self.diverged += not self._on_track

    def propose(self, ctx: StepContext) -> DraftTree:
        """The root and ``chain`` drafted tokens: a run of right ones (each kept with probability
        ``acceptance``), then wrong ones. Off the reference (a divergence), every drafted token is a
        wrong one."""
        # generated tokens so far, the root included
        emitted = ctx.tokens.numel() - self._prompt_len
        ref = self._reference
        known = min(emitted, ref.numel())
        if self._on_track and not torch.equal(
            ctx.tokens[self._prompt_len : self._prompt_len + known], ref[:known]
        ):
            self._on_track = False
            self.diverged += 1
        right = 0
        while self._on_track and right < self.chain and self._rng.random() < self.acceptance:
            right += 1
        drafted, previous = [], ctx.root_token
        for j in range(self.chain):
            inside = emitted + j < ref.numel()
            truth = int(ref[emitted + j]) if inside else previous
            # beyond the reference nothing is known: a token other than the previous one stands in
            previous = truth if j < right and inside else wrong_token(truth)
            drafted.append(previous)
        if self.draft_ms > 0:
            spin_wait(self.draft_ms)
        self.draft_calls += 1
        return DraftTree.chain([ctx.root_token, *drafted])

    def accept(self, ctx: StepContext) -> None:
        """Stateless: the next step finds its place from the emitted tokens."""
