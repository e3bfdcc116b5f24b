"""Static trees, tree construction, verifiers and stop policies on hand-made inputs."""

from __future__ import annotations

import pytest
import torch

from draftsmith.common.trees import default_medusa_tree, tree_from_head_accuracies
from draftsmith.runtime.acceptance.rejection_sampling import RejectionSamplingVerifier
from draftsmith.runtime.acceptance.stop_policies import (
    ConfidenceStop,
    FixedDepth,
    LearnedStop,
    StopContext,
    StopPolicy,
)
from draftsmith.runtime.acceptance.verifiers import GreedyVerifier, TypicalVerifier, target_probs
from draftsmith.runtime.drafting.base import StepContext
from draftsmith.runtime.drafting.medusa import MedusaProposer
from draftsmith.runtime.drafting.tree import DraftTree, StaticTree

pytestmark = pytest.mark.unit

PATHS = [[1], [0], [0, 0], [0, 1], [1, 0], [0, 0, 0]]  # deliberately unsorted


@pytest.fixture
def static_tree() -> StaticTree:
    return StaticTree.from_paths(PATHS, top_k=3)


def test_static_tree_structure(static_tree):
    # nodes: 0 root, 1 (0,), 2 (1,), 3 (0,0), 4 (0,1), 5 (1,0), 6 (0,0,0)
    assert static_tree.paths == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    assert static_tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert static_tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    expected_mask = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],
            [1, 0, 1, 0, 0, 1, 0],
            [1, 1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(static_tree.tree_mask, expected_mask)
    assert static_tree.retrieve_indices.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    # Medusa gather index: choice[-1] + top_k * depth + 1 into [root] + top3(head0) + top3(head1) +
    # top3(head2)
    assert static_tree.candidate_index.tolist() == [0, 1, 2, 4, 5, 4, 7]
    assert static_tree.num_nodes == 7 and static_tree.depth == 3


def test_static_tree_build_gathers_head_topk(static_tree):
    head_topk = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    tree = static_tree.build(99, head_topk)
    assert tree.tokens.tolist() == [99, 10, 11, 20, 21, 20, 30]
    assert tree.children(1) == [3, 4] and tree.children(6) == []


@pytest.mark.parametrize(
    "paths, match",
    [
        ([[0, 1]], "no parent path"),
        ([[0], [3]], "top_k=3"),
        ([[0], [0]], "duplicate"),
        ([], "at least one path"),
    ],
)
def test_static_tree_rejects_bad_paths(paths, match):
    with pytest.raises(ValueError, match=match):
        StaticTree.from_paths(paths, top_k=3)


def test_draft_tree_validation():
    with pytest.raises(ValueError, match="parents must precede"):
        DraftTree.from_parents([1, 2, 3], [-1, 2, 0])
    with pytest.raises(ValueError, match="needs draft_q"):
        DraftTree.chain([1, 2], draft_mode="with_replacement")
    chain = DraftTree.chain([5, 6, 7])
    assert chain.retrieve_indices.tolist() == [[0, 1, 2]]
    assert torch.equal(chain.tree_mask, torch.ones(3, 3, dtype=torch.bool).tril())


def test_optimal_tree_from_head_accuracies():
    acc = [[0.6, 0.2], [0.5, 0.1]]
    # path products: (0)=.6 (0,0)=.3 (1)=.2 (1,0)=.1 (0,1)=.06 (1,1)=.02
    assert tree_from_head_accuracies(acc, 4) == [[0], [0, 0], [1], [1, 0]]
    acc3 = [[0.7, 0.2, 0.1], [0.5, 0.3, 0.1], [0.4, 0.2, 0.1]]
    # (0)=.7 (0,0)=.35 (0,1)=.21 (1)=.2 (0,0,0)=.14 (1,0)=.1 (0,1,0)=.084 (0,0,1)=.07 ...
    assert tree_from_head_accuracies(acc3, 6) == [[0], [0, 0], [0, 1], [1], [0, 0, 0], [1, 0]]
    # The result is always a valid tree (every prefix present).
    StaticTree.from_paths(tree_from_head_accuracies(acc3, 20), top_k=3)


def test_default_medusa_tree_is_valid_and_sized():
    paths = default_medusa_tree(num_heads=3, num_nodes=12, top_k=4)
    tree = StaticTree.from_paths(paths, top_k=4)
    assert tree.num_nodes == 13 and tree.depth == 3
    assert [0] in paths and [0, 0] in paths and [0, 0, 0] in paths
    # capped by what exists
    assert len(default_medusa_tree(num_heads=1, num_nodes=50, top_k=2)) == 2


def hand_tree_and_logits():
    """Root 9; children 3 (node 1) and 4 (node 2); node 1 has children 6 (node 3) and 5 (node 4);
    node 4 -> 7."""
    tree = DraftTree.from_parents([9, 3, 4, 6, 5, 7], [-1, 0, 0, 1, 1, 4])
    logits = torch.zeros(6, 10)
    logits[0, 3] = 5.0  # target after root: 3 -> node 1 accepted
    logits[1, 5] = 5.0  # after 3: 5 -> node 4 (the second child) accepted
    logits[4, 7] = 5.0  # after 5: 7 -> node 5 accepted
    logits[5, 2] = 5.0  # bonus
    return tree, logits


def test_greedy_verifier_picks_the_longest_path_and_bonus():
    tree, logits = hand_tree_and_logits()
    acc = GreedyVerifier("torch").verify(tree, logits)
    assert acc.path_nodes == [0, 1, 4, 5]
    assert acc.accepted_tokens == [3, 5, 7] and acc.bonus_token == 2 and acc.num_accepted == 3
    logits[1, 5], logits[1, 8] = 0.0, 5.0  # mismatch at depth 2: stop after node 1, bonus 8
    acc = GreedyVerifier("torch").verify(tree, logits)
    assert acc.path_nodes == [0, 1] and acc.bonus_token == 8 and acc.num_accepted == 1


def test_typical_verifier_accepts_plausible_tokens():
    tree, logits = hand_tree_and_logits()
    logits[1, 6] = 4.9  # 6 is nearly as likely as 5 after 3: typical, but node 4's branch is longer
    acc = TypicalVerifier(temperature=1.0).verify(tree, logits)
    assert acc.path_nodes == [0, 1, 4, 5] and acc.bonus_token == 2
    logits[
        4, 7
    ] = -5.0  # 7 becomes implausible: both depth-2 nodes are accepted, tie broken by log-prob
    acc = TypicalVerifier(temperature=1.0).verify(tree, logits)
    assert acc.path_nodes == [0, 1, 4] and acc.num_accepted == 2
    assert (
        not TypicalVerifier().lossless
        and GreedyVerifier().lossless
        and RejectionSamplingVerifier().lossless
    )
    with pytest.raises(ValueError, match="GreedyVerifier"):
        TypicalVerifier(temperature=0)


def test_rejection_sampler_deterministic_cases():
    tree, logits = hand_tree_and_logits()
    logits = logits * 100  # near one-hot target: point-mass drafts that match are always accepted
    acc = RejectionSamplingVerifier(temperature=1.0).verify(
        tree, logits, torch.Generator().manual_seed(0)
    )
    assert acc.path_nodes == [0, 1, 4, 5] and acc.bonus_token == 2
    with pytest.raises(ValueError, match="GreedyVerifier"):
        RejectionSamplingVerifier(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        RejectionSamplingVerifier(top_p=0.0)


def test_rejection_sampler_rejects_inconsistent_draft_q():
    q = torch.zeros(2, 10)
    q[0, 1] = 1.0  # the child drawn was 3, which has q = 0
    tree = DraftTree.chain([9, 3], q, "with_replacement")
    with pytest.raises(ValueError, match="inconsistent"):
        RejectionSamplingVerifier().verify(tree, torch.zeros(2, 10))


def test_target_probs_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(
        target_probs(logits, 1.0, 0.7), torch.tensor([0.625, 0.375, 0, 0], dtype=torch.float64)
    )
    assert torch.allclose(
        target_probs(logits, 1.0, 0.85),
        torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
        / 0.95
        * torch.tensor([1, 1, 1, 0.0], dtype=torch.float64),
    )


def test_stop_policies():
    assert FixedDepth(2).should_stop(StopContext(2, 1.0)) and not FixedDepth(2).should_stop(
        StopContext(1, 0.0)
    )
    stop = ConfidenceStop(threshold=0.4, max_depth=5)
    assert stop.should_stop(StopContext(1, 0.3)) and not stop.should_stop(StopContext(1, 0.5))
    assert stop.should_stop(StopContext(5, 0.9))
    head = torch.nn.Linear(4, 1)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.constant_(head.bias, 2.0)  # sigmoid(2) = 0.88: predicts a rejection
    learned = LearnedStop(head, threshold=0.7)
    assert learned.should_stop(StopContext(1, 0.9, torch.zeros(4))) and not LearnedStop(
        head, threshold=0.95
    ).should_stop(StopContext(1, 0.9, torch.zeros(4)))
    with pytest.raises(ValueError, match="drafter state"):
        learned.should_stop(StopContext(1, 0.9, None))
    for p in (FixedDepth(), stop, learned):
        assert isinstance(p, StopPolicy)


def test_learned_stop_accumulates_along_a_path_and_branches_keep_their_own():
    """SpecDec++: stop at the first depth d where 1 - prod_{i<=d}(1 - p_reject_i) > h (not before,
    not after)."""
    head = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(head.weight)  # logit = state value
    p_reject = torch.tensor([0.1, 0.2, 0.3, 0.4])
    states = torch.log(p_reject / (1 - p_reject))[
        :, None
    ]  # [4, 1] logits giving those rejection probabilities
    policy = LearnedStop(head, threshold=0.45, max_depth=8)
    ctx, stops = StopContext(0, 1.0), []
    for d in range(4):
        ctx = ctx.child(d + 1, 0.5, states[d])
        stops.append(policy.should_stop(ctx))
    # 1 - 0.9 = 0.1, 1 - 0.72 = 0.28, 1 - 0.504 = 0.496 > 0.45: stop exactly after the third token
    assert stops == [False, False, True, True]
    assert ctx.path["accept_prob"] == pytest.approx(0.9 * 0.8 * 0.7 * 0.6)
    first = StopContext(0, 1.0).child(1, 0.5, states[0])
    policy.should_stop(first)
    sibling_a, sibling_b = first.child(2, 0.5, states[1]), first.child(2, 0.5, states[3])
    assert not policy.should_stop(sibling_a) and policy.should_stop(
        sibling_b
    )  # 0.28 vs 1 - 0.9*0.6 = 0.46
    assert first.path["accept_prob"] == pytest.approx(
        0.9
    )  # the branches did not write into the parent's scratch
    with pytest.raises(ValueError, match="drafter state"):
        policy.should_stop(StopContext(1, 0.9))
    assert (
        LearnedStop(head, threshold=0.0, min_depth=2).should_stop(StopContext(1, 0.5, states[3]))
        is False
    )


class FixedHeads(torch.nn.Module):
    """Stand-in Medusa heads returning fixed logits [K, V] whatever the hidden state."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("fixed", logits)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fixed


def test_medusa_proposer_fills_tree_and_prunes_with_stop_policy():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.6, 0.05, 0.25], [0.9, 0.05, 0.03, 0.02]])
    proposer = MedusaProposer(FixedHeads(probs.log()), PATHS, top_k=3)
    state = StepContext(tokens=torch.tensor([1, 2]), root_token=2, hidden=torch.zeros(8))
    tree = proposer.propose(state)
    # head0 top3 = [0, 1, 2], head1 top3 = [1, 3, 0], head2 top3 = [0, 1, 2]
    assert tree.tokens.tolist() == [2, 0, 1, 1, 3, 1, 0]
    # Confidence 0.35: node 1 (p=.5) expands, node 2 (p=.3) does not; depth-2 nodes (.6/.25) -> only
    # node 3 expands.
    state.stop_policy = ConfidenceStop(threshold=0.35, max_depth=3)
    pruned = proposer.propose(state)
    assert pruned.tokens.tolist() == [2, 0, 1, 1, 3, 0]
    assert pruned.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    state.stop_policy = FixedDepth(1)
    assert proposer.propose(state).tokens.tolist() == [2, 0, 1]
