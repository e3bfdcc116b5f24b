"""EAGLE draft trees on a known distribution: a bigram stand-in drafter whose next-token law is
fixed gives the known dynamic tree (mapped to the target vocabulary or not), the stop policies and
chains cut it where they should, and a sampled chain records its law on the target vocabulary."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftsmith.drafters.eagle import KVCache
from draftsmith.runtime.acceptance.stop_policies import ConfidenceStop, FixedDepth
from draftsmith.runtime.drafting.base import StepContext
from draftsmith.runtime.drafting.eagle import DraftModel, EagleProposer

pytestmark = pytest.mark.unit


# Next-token law of a bigram "drafter" over a 5-token draft vocabulary (rows: previous token).
BIGRAM = torch.tensor(
    [
        [0.05, 0.50, 0.30, 0.10, 0.05],
        [0.05, 0.05, 0.00, 0.70, 0.20],
        [0.03, 0.90, 0.00, 0.05, 0.02],
        [0.40, 0.05, 0.05, 0.00, 0.50],
        [0.20, 0.20, 0.20, 0.20, 0.20],
    ],
    dtype=torch.float64,
)


class BigramStub(DraftModel):
    """A DraftModel whose logits only depend on the input token; it records every call and keeps a
    dummy cache."""

    feature_taps = ()

    def __init__(self, draft_ids: torch.Tensor | None = None, vocab_size: int = 5) -> None:
        self.draft_ids, self.vocab_size = draft_ids, vocab_size
        ids = torch.arange(5) if draft_ids is None else draft_ids
        self.to_draft = torch.full((vocab_size,), -1, dtype=torch.long).index_copy_(
            0, ids, torch.arange(5)
        )
        self.calls: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []

    def features(self, feats):
        return feats[None]

    def step(self, hidden, ids, cache, positions, tree_mask, last_only):
        self.calls.append((ids.clone(), positions, tree_mask))
        d = self.to_draft[ids]  # [1, S] draft ids
        assert bool((d >= 0).all()), "the stub got a token outside its vocabulary"
        logits = BIGRAM.clamp(min=1e-9).log().float()[d]  # [1, S, 5]
        entry = torch.zeros(1, 1, ids.shape[1], 1)
        cache = KVCache(entry, entry) if cache is None else cache.append(entry, entry)
        return F.one_hot(d, 5).float(), logits[:, -1:] if last_only else logits, cache


def propose_once(proposer: EagleProposer, prompt: list[int], root: int, policy=None):
    tokens = torch.tensor(prompt + [root])
    proposer.begin(StepContext(tokens=tokens, root_token=root, hidden=torch.zeros(len(prompt), 1)))
    return proposer.propose(
        StepContext(tokens=tokens, root_token=root, hidden=torch.zeros(1), stop_policy=policy)
    )


@pytest.mark.parametrize("mapped", [False, True])
def test_dynamic_tree_on_a_fixed_distribution_gives_the_known_tree(mapped):
    # Scores (products of probabilities) of the generated nodes, in generation order: depth 1: 1
    # .50, 2 .30 | expansion 1: 1>3 .35, 1>4 .10, 2>1 .27, 2>3 .015 -> frontier {1>3, 2>1} expansion
    # 2: 1>3>4 .175, 1>3>0 .14, 2>1>3 .189, 2>1>4 .054. Best 6: .50 .35 .30 .27 .189 .175.
    # reduced vocab: target id 3d + 1
    draft_ids = torch.tensor([1, 4, 7, 10, 13]) if mapped else None
    stub = BigramStub(draft_ids, 16 if mapped else 5)
    tgt = (lambda d: [int(draft_ids[i]) for i in d]) if mapped else (lambda d: list(d))
    proposer = EagleProposer(stub, "tree", total_tokens=7, depth=2, top_k=2)
    tree = propose_once(proposer, tgt([0, 0]), tgt([0])[0])
    assert tree.tokens.tolist() == tgt([0, 1, 2, 3, 1, 4, 3])
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2, 3, 4]
    assert torch.allclose(
        tree.draft_confidence, torch.tensor([1, 0.5, 0.3, 0.7, 0.9, 0.5, 0.7]), atol=1e-5
    )
    assert tree.draft_mode == "point_mass" and tree.draft_q is None
    # One drafter forward per level: the root step (prompt pairs + root), then each frontier in one
    # batch.
    (ids0, pos0, mask0), (ids1, pos1, mask1), (ids2, pos2, mask2) = stub.calls
    assert ids0.tolist() == [tgt([0, 0])] and pos0 is None and mask0 is None
    assert ids1.tolist() == [tgt([1, 2])] and pos1.tolist() == [[2, 2]]
    assert mask1.int().tolist() == [[1, 1, 1, 0], [1, 1, 0, 1]]
    assert ids2.tolist() == [tgt([3, 1])] and pos2.tolist() == [[3, 3]]
    # 1>3 sees its parent 1 (first tree entry), 2>1 its parent 2 (second), each itself.
    assert mask2.int().tolist() == [[1, 1, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1]]
    # speculative entries are not kept
    assert proposer.num_committed == 2 and proposer.cache.length == 2


def test_stop_policies_and_chain_on_the_fixed_distribution():
    stub = BigramStub()
    tree_proposer = EagleProposer(stub, "tree", total_tokens=7, depth=2, top_k=2)
    # Node 2 (p .3) and node 1>4 (p .2) fall below the confidence threshold: they get no children.
    tree = propose_once(tree_proposer, [0, 0], 0, ConfidenceStop(0.4, max_depth=8))
    assert tree.tokens.tolist() == [0, 1, 2, 3, 4, 4, 0] and tree.parents.tolist() == [
        -1,
        0,
        0,
        1,
        1,
        3,
        3,
    ]
    tree = propose_once(tree_proposer, [0, 0], 0, FixedDepth(1))
    assert tree.tokens.tolist() == [0, 1, 2] and tree.parents.tolist() == [-1, 0, 0]
    chain = EagleProposer(stub, "chain", depth=2)
    assert chain.max_tree_nodes == 4
    tree = propose_once(chain, [0, 0], 0)
    assert tree.tokens.tolist() == [0, 1, 3, 4] and tree.parents.tolist() == [
        -1,
        0,
        1,
        2,
    ]  # greedy: depth + 1 drafts
    assert propose_once(chain, [0, 0], 0, FixedDepth(2)).tokens.tolist() == [0, 1, 3]
    assert propose_once(chain, [0, 0], 0, ConfidenceStop(0.6)).tokens.tolist() == [
        0,
        1,
    ]  # p(1) = .5 < .6
    with pytest.raises(ValueError, match="temperature > 0 is for policy='chain'"):
        EagleProposer(stub, "tree", temperature=1.0)
    with pytest.raises(ValueError, match="top_k <= 5"):
        EagleProposer(stub, "tree", top_k=6)
    with pytest.raises(RuntimeError, match="call begin"):
        EagleProposer(stub).propose(
            StepContext(tokens=torch.tensor([0, 0]), root_token=0, hidden=torch.zeros(1))
        )


def test_sampled_chain_records_its_law_on_the_target_vocabulary():
    stub = BigramStub(torch.tensor([1, 4, 7, 10, 13]), 16)
    proposer = EagleProposer(stub, "chain", depth=1, temperature=0.5)
    proposer.begin(StepContext(tokens=torch.tensor([1, 1]), root_token=1, hidden=torch.zeros(1, 1)))
    tree = proposer.propose(
        StepContext(
            tokens=torch.tensor([1, 1]),
            root_token=1,
            hidden=torch.zeros(1),
            generator=torch.Generator().manual_seed(0),
        )
    )
    assert tree.draft_mode == "with_replacement" and tree.draft_q.shape == (3, 16)
    expected = torch.zeros(16, dtype=torch.float64)
    expected[[1, 4, 7, 10, 13]] = torch.softmax(BIGRAM[0].log() / 0.5, -1)
    torch.testing.assert_close(tree.draft_q[0], expected, atol=1e-6, rtol=0)
    assert tree.draft_q[2].sum() == 0 and float(tree.draft_q[0, tree.tokens[1]]) > 0
