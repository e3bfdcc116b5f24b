"""The speculative loop's bookkeeping around the native calls, made cheaper without changing what it
computes: the dynamic tree's rerank ranks Python floats (the same nodes as a stable torch sort), a
one-level tree skips the frontier set-up, the accepted rows reach the proposer as views when they
are the first nodes and as a gather otherwise, and RoPE rows of explicit positions are one
``index_select``."""

from __future__ import annotations

import math

import pytest
import torch
from test_eagle_draft_trees import BigramStub, propose_once
from test_speculative import tiny_llama

from draftsmith.runtime.acceptance.stop_policies import FixedDepth
from draftsmith.runtime.acceptance.verifiers import Acceptance
from draftsmith.runtime.decoding import speculative_step
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.decoding.speculative_step import LoopState
from draftsmith.runtime.drafting.base import StepContext
from draftsmith.runtime.drafting.eagle_proposer import EagleProposer
from draftsmith.runtime.drafting.eagle_tree import GeneratedNodes, rerank
from draftsmith.runtime.drafting.tree import DraftTree
from draftsmith.runtime.target.output import TargetOutput

pytestmark = pytest.mark.unit


def torch_rerank(
    total: int, root: int, tokens: list, scores: list, local: list, parents: list
) -> DraftTree:
    """The rerank as it was written in torch ops (stable sort of -score, finite ones kept): the
    oracle."""
    all_scores = torch.cat(scores)
    order = torch.sort(-all_scores, stable=True).indices[: total - 1]
    keep = order[torch.isfinite(all_scores[order])].sort().values
    node_of = torch.full((all_scores.numel(),), -1, dtype=torch.long)
    node_of[keep] = torch.arange(1, keep.numel() + 1)
    gen_parent = torch.cat(parents)[keep]
    tree_parent = torch.where(
        gen_parent < 0, torch.zeros_like(gen_parent), node_of[gen_parent.clamp(min=0)]
    )
    assert not bool((tree_parent < 0).any())
    conf = torch.cat([torch.ones(1), torch.cat(local)[keep].exp()])
    node_tokens = torch.cat([torch.tensor([root]), torch.cat(tokens)[keep]])
    return DraftTree.from_parents(node_tokens, [-1, *tree_parent.tolist()], draft_confidence=conf)


def random_levels(seed: int, k: int, levels: int) -> tuple[list, list, list, list[int]]:
    """Generated nodes as ``_tree`` makes them: per level tokens, cumulative scores, local log-probs
    and (flat) generation parents; scores on a coarse grid (ties), some frontier nodes stopped
    (their children -inf).
    """
    g = torch.Generator().manual_seed(seed)
    local = [
        -(torch.randint(0, 4, (k,), generator=g).float() / 2)
    ]  # log p in {0, -.5, -1, -1.5}: ties
    scores, parents = [local[0].clone()], [-1] * k
    tokens = [torch.randint(0, 1000, (k,), generator=g)]
    for _ in range(1, levels):
        base = len(parents)
        frontier = torch.randperm(base, generator=g)[
            :k
        ]  # any earlier nodes: the rerank must not rely on top-k
        lp = -(torch.randint(0, 4, (k * k,), generator=g).float() / 2)
        parent_score = torch.cat(scores)[frontier].repeat_interleave(k)
        stopped = (torch.rand(k, generator=g) < 0.3).repeat_interleave(k)
        scores.append((parent_score + lp).masked_fill(stopped, float("-inf")))
        local.append(lp)
        tokens.append(torch.randint(0, 1000, (k * k,), generator=g))
        parents.extend(frontier.repeat_interleave(k).tolist())
    return tokens, scores, local, parents


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("total", [2, 5, 9, 40])
def test_rerank_keeps_the_nodes_a_stable_torch_sort_keeps(seed, total):
    k, levels = 3, 1 + seed % 3
    tokens, scores, local, parents = random_levels(seed, k, levels)
    got = rerank(total, 77, GeneratedNodes(tokens, scores, local, parents))
    flat_parents = [torch.tensor(parents[:k])] + [
        torch.tensor(parents[k + i * k * k : k + (i + 1) * k * k]) for i in range(levels - 1)
    ]
    want = torch_rerank(total, 77, tokens, scores, local, flat_parents)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
    assert torch.equal(
        got.draft_confidence, want.draft_confidence
    )  # bit for bit: the same exp of the same rows


def test_rerank_drops_nodes_scored_minus_infinity():
    logp = torch.tensor([-0.1, -0.2, float("-inf"), float("-inf")])
    tree = rerank(8, 5, GeneratedNodes([torch.tensor([10, 11, 12, 13])], [logp], [logp], [-1] * 4))
    assert tree.tokens.tolist() == [5, 10, 11] and tree.parents.tolist() == [-1, 0, 0]
    assert torch.allclose(
        tree.draft_confidence, torch.tensor([1.0, math.exp(-0.1), math.exp(-0.2)])
    )


@pytest.mark.parametrize("total", [3, 16])
def test_a_one_level_tree_is_the_root_steps_top_k_in_one_drafter_call(total):
    stub = BigramStub()
    proposer = EagleProposer(stub, "tree", total_tokens=total, depth=4, top_k=4)
    tree = propose_once(
        proposer, [0, 0], 0, FixedDepth(1)
    )  # BIGRAM row 0: .50 (1), .30 (2), .10 (3), .05 (0|4)
    kept = min(4, total - 1)
    assert tree.tokens.tolist() == [0, 1, 2, 3, 0][: kept + 1]
    assert tree.parents.tolist() == [-1] + [0] * kept
    assert torch.allclose(
        tree.draft_confidence, torch.tensor([1, 0.5, 0.3, 0.1, 0.05])[: kept + 1], atol=1e-6
    )
    assert len(stub.calls) == 1  # the root step only: no frontier forward for one level


class RecordingProposer:
    """Drafts [wrong, right] children of the root from a known continuation, so that the accepted
    path is the second child (a gather, not a prefix) every other step; records what ``accept``
    hands it (copies).
    """

    reads_logits = True
    max_tree_nodes = 3

    def __init__(self, continuation: list[int], taps: tuple[int, ...], vocab: int) -> None:
        self.continuation, self.feature_taps, self.vocab = continuation, taps, vocab
        self.seen: list[tuple[int, list[int], torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.step = 0

    def begin(self, ctx: StepContext) -> None:
        self.prompt_len = ctx.tokens.numel() - 1

    def propose(self, ctx: StepContext) -> DraftTree:
        done = ctx.tokens.numel() - self.prompt_len  # generated so far, the root included
        right = self.continuation[done] if done < len(self.continuation) else 0
        wrong = (right + 1) % self.vocab
        self.step += 1
        children = [wrong, right] if self.step % 2 else [right, wrong]
        return DraftTree.from_parents([ctx.root_token, *children], [-1, 0, 0])

    def accept(self, ctx: StepContext) -> None:
        root_at = ctx.tokens.numel() - 1  # the root's position in the sequence
        self.seen.append(
            (
                root_at,
                ctx.acceptance.path_nodes,
                ctx.hidden.clone(),
                ctx.taps.clone(),
                ctx.logits.clone(),
            )
        )


def test_the_accepted_rows_reach_the_proposer_whether_a_prefix_or_a_gather():
    _, model = tiny_llama(0, head_scale=8.0)
    prompt, new = [1, 5, 9, 30, 7], 20
    reference = generate_ar(model, prompt, new)
    proposer = RecordingProposer(reference, (0, 2), 256)
    res = SpeculativeDecoder(model, proposer).generate(prompt, new)
    assert res.tokens == reference
    paths = [nodes for _, nodes, *_ in proposer.seen]
    assert [0, 1] in paths and [0, 2] in paths  # both the view and the gather were taken
    # Every row handed over is the target's own row at that sequence position (one full forward
    # recomputes them).
    seq = torch.tensor(prompt + reference)
    full = model.forward(seq, model.allocate_cache(seq.numel()), taps=(0, 2))
    full_taps = full.tap_features((0, 2))
    for root_at, nodes, hidden, taps, logits in proposer.seen:
        rows = slice(root_at, root_at + len(nodes))
        torch.testing.assert_close(hidden, full.hidden[rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(taps, full_taps[rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits, full.logits[rows], atol=1e-4, rtol=1e-4)


def test_missing_taps_are_named_when_the_accepted_rows_are_handed_over():
    _, model = tiny_llama(0)
    dec = SpeculativeDecoder(model, RecordingProposer([], (1,), 256))
    out = TargetOutput(torch.zeros(3, 8), torch.zeros(3, 4), {0: torch.zeros(3, 4)})
    acc = Acceptance([0, 2], [9], 4, 1)
    # only the root, the taps and the generator of the loop are read when the path is handed over
    loop = LoopState(None, torch.device("cpu"), (1,), None, False, None, None, None, 2, None)
    with pytest.raises(ValueError, match=r"no taps for layers \[1\]"):
        speculative_step._accept_path(
            dec, out, acc, torch.tensor([0, 2]), torch.tensor([1, 2]), loop
        )


def test_rope_rows_of_explicit_positions_are_the_table_rows():
    _, model = tiny_llama(0)
    positions = torch.tensor([7, 3, 3, 12])
    cos, sin = model._rope_rows(0, 4, positions)
    assert torch.equal(cos, model._cos[[7, 3, 3, 12]]) and torch.equal(
        sin, model._sin[[7, 3, 3, 12]]
    )
    # Explicit consecutive positions and the default ones give the same forward.
    ids = torch.tensor([4, 8, 15, 16, 23])
    a = model.forward(ids, model.allocate_cache(8)).logits
    b = model.forward(ids, model.allocate_cache(8), positions=torch.arange(5)).logits
    assert torch.equal(a, b)
