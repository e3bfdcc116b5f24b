"""The Clover-2 proposer: regressive expansion per depth equals one node at a time, the augmenting
block's cache equals one pass over the final sequence, and greedy decoding is lossless."""

from __future__ import annotations

import pytest
import torch
from test_speculative import PROMPTS, plain_greedy, tiny_llama

from draftsmith.heads.clover import CloverConfig, CloverHeads
from draftsmith.runtime.acceptance.stop_policies import ConfidenceStop
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import StepContext
from draftsmith.runtime.drafting.clover import CloverProposer

pytestmark = pytest.mark.unit

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, head_scale=8.0)[1]


def random_heads(lean, seed: int = 0) -> CloverHeads:
    torch.manual_seed(seed)
    c = lean.config
    heads = CloverHeads(
        CloverConfig(
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_heads=3,
            num_layers=1,
        ),
        lean.embed_weight,
        lean.lm_head_weight,
    )
    for p in heads.parameters():
        p.data.normal_(0, 0.2)
    return heads.eval()


def test_regressive_expansion_equals_one_node_at_a_time(target):
    heads = random_heads(target)
    proposer = CloverProposer(heads, TREE, target.config.num_layers, top_k=3)
    prompt = torch.tensor([1, 5, 9, 2, 7])
    res = target.forward(prompt, target.allocate_cache(8), taps=proposer.feature_taps)
    root = int(res.logits[-1].argmax())
    tokens = torch.cat([prompt, torch.tensor([root])])
    proposer.begin(
        StepContext(
            tokens=tokens,
            root_token=root,
            hidden=res.hidden,
            taps=res.tap_features(proposer.feature_taps),
        )
    )
    tree = proposer.propose(StepContext(tokens=tokens, root_token=root, hidden=res.hidden[-1]))
    with torch.no_grad():
        c = heads.context(res.taps[target.config.num_layers][None], tokens[1:][None])[0][
            0, -1
        ]  # [H]
        state, token_of = {(): c}, {}
        for i, path in enumerate(proposer.tree.paths, start=1):
            parent = path[:-1]
            if parent:  # the parent's regressive state from its own parent's state and its token
                logits = heads.step(state[parent[:-1]][None], torch.tensor([token_of[parent]]))
                state[parent] = logits[0][0]
                logits = logits[2][0]
            else:
                logits = heads.first(c[None])[2][0]
            token_of[path] = int(logits.topk(3).indices[path[-1]])
            assert int(tree.tokens[i]) == token_of[path], f"node {i} (path {list(path)})"


def test_clover_greedy_is_lossless_and_its_cache_holds_exactly_the_committed_pairs(target):
    heads = random_heads(target, seed=1)
    layers = target.config.num_layers
    for policy in (None, ConfidenceStop(0.05, max_depth=2)):
        proposer = CloverProposer(heads, TREE, layers, top_k=3)
        decoder = SpeculativeDecoder(target, proposer, stop_policy=policy)
        for prompt in PROMPTS:
            out = decoder.generate(prompt, 32).tokens
            assert out == plain_greedy(target, prompt, 32)
    seq = torch.tensor(
        PROMPTS[-1] + out
    )  # the last generation: every token but the final bonus was paired
    full = target.forward(seq, target.allocate_cache(seq.numel()), taps=(layers,)).taps[layers]
    with torch.no_grad():
        c_full = heads.context(full[None, :-1], seq[None, 1:])[0][0, -1]
    torch.testing.assert_close(proposer._c, c_full, atol=1e-4, rtol=1e-4)
    assert proposer._caches[0].length == seq.numel() - 1


def test_drafting_through_the_targets_own_lm_head_gives_the_same_drafts(target):
    """At load the runtime drafts through the target's own (fast) LM head instead of a second copy:
    same logits, and greedy decoding stays lossless through it."""
    heads = random_heads(target, seed=3)
    out = torch.randn(5, target.config.hidden_size)
    before = heads.logits(out)
    heads.lm_head_fn = target.lm_head_logits
    # the same weights, not a copy
    assert heads.lm_head_weight.data_ptr() == target.lm_head_weight.data_ptr()
    torch.testing.assert_close(heads.logits(out), before)
    decoder = SpeculativeDecoder(
        target, CloverProposer(heads, TREE, target.config.num_layers, top_k=3)
    )
    for prompt in PROMPTS:
        assert decoder.generate(prompt, 24).tokens == plain_greedy(target, prompt, 24)
