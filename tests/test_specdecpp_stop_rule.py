"""SpecDec++'s learned stop rule: it stops at exactly the step its formula gives (reading the state
of the token it decides after), and rejection sampling under it keeps the target's law whatever the
head says."""

from __future__ import annotations

import pytest
import torch
from test_eagle_draft_trees import BigramStub, propose_once
from test_speculative_sampling import (
    ALPHA,
    SMALL_V,
    chi2_pvalue,
    small_target,  # noqa: F401 (fixture)
)

from draftsmith.drafters.eagle import EagleConfig, EagleDrafter
from draftsmith.runtime.acceptance.rejection_sampling import RejectionSamplingVerifier
from draftsmith.runtime.acceptance.stop_policies import LearnedStop, StopContext
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.eagle_adapters import Eagle1DraftModel
from draftsmith.runtime.drafting.eagle_proposer import EagleProposer
from draftsmith.runtime.drafting.specdecpp import LearnedStopProposer

pytestmark = pytest.mark.unit


class ScriptedHead(torch.nn.Module):
    """Returns the rejection logit of a scripted P(reject) per call, recording the states it
    reads."""

    def __init__(self, p_reject: list[float]) -> None:
        super().__init__()
        self.p, self.states = p_reject, []

    def forward(self, state):
        self.states.append(state.detach().clone())
        p = torch.tensor(self.p[min(len(self.states), len(self.p)) - 1])
        return torch.log(p / (1 - p)).reshape(1)


def expected_depth(p_reject, h, max_depth, min_depth=1):
    """The rule by hand: the first depth d >= min_depth with 1 - prod_{i<=d}(1 - p_i) > h, else
    max_depth."""
    keep = 1.0
    for d, p in enumerate(p_reject, start=1):
        keep *= 1 - p
        if d >= max_depth or (d >= min_depth and 1 - keep > h):
            return d
    return max_depth


@pytest.mark.parametrize(
    "p_reject,h,min_depth",
    [
        ([0.6, 0.1, 0.1], 0.5, 1),  # first step: P(reject) of token 1 alone exceeds h
        (
            [0.1, 0.1, 0.5, 0.1],
            0.5,
            1,
        ),  # 0.1, 0.19, 0.595: token 3's own estimate tips it (no off-by-one)
        ([0.1, 0.1, 0.31, 0.1], 0.5, 1),  # 0.1, 0.19, 0.4411, 0.497: never, up to max_depth
        ([0.9, 0.1, 0.1], 0.5, 2),  # min_depth holds the first stop back
    ],
)
def test_learned_rule_stops_at_exactly_the_formula_step(p_reject, h, min_depth):
    want = expected_depth(p_reject, h, 4, min_depth)
    policy = LearnedStop(ScriptedHead(p_reject), threshold=h, max_depth=4, min_depth=min_depth)
    ctx, stopped = StopContext(0, 1.0), None
    for d in range(1, 5):
        ctx = ctx.child(d, 0.5, torch.zeros(2))
        if policy.should_stop(ctx):
            stopped = d
            break
    assert stopped == want
    # In a chain proposer the rule decides after token d from the state whose input is token d.
    head = ScriptedHead(p_reject)
    chain = EagleProposer(BigramStub(), "chain", depth=7)
    tree = propose_once(
        chain, [0, 0], 0, LearnedStop(head, threshold=h, max_depth=4, min_depth=min_depth)
    )
    assert tree.num_nodes - 1 == want
    drafted = tree.tokens[1:].tolist()
    # BigramStub's output is one_hot(input token): the d-th state the head read is the d-th drafted
    # token's.
    assert [int(s.argmax()) for s in head.states] == drafted[: len(head.states)]


class HashHead(torch.nn.Module):
    """A deterministic, strongly state-dependent rejection logit (so the draft length really
    varies)."""

    def forward(self, state):
        return 4 * torch.sin(1000 * state.float().sum(-1))


def test_rejection_sampling_with_the_learned_rule_keeps_the_target_law(small_target):  # noqa: F811
    lean, prompt, joint = small_target
    torch.manual_seed(3)
    hf_cfg = {
        "hidden_size": 32,
        "vocab_size": SMALL_V,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
    }
    drafter = EagleDrafter(EagleConfig(**hf_cfg), lean.embed_weight, lean.lm_head_weight).eval()
    # any function of the drafter state: the stop decision never looks at the verifier
    head = HashHead()
    base = EagleProposer(Eagle1DraftModel(drafter), "chain", depth=3, temperature=1.0)
    proposer = LearnedStopProposer(base, head, LearnedStop(head, threshold=0.5, max_depth=3))
    dec = SpeculativeDecoder(lean, proposer, RejectionSamplingVerifier(temperature=1.0))
    counts, gen, depths = torch.zeros(SMALL_V, SMALL_V), torch.Generator().manual_seed(0), set()
    for _ in range(1000):
        res = dec.generate(prompt, 2, generator=gen)
        counts[res.tokens[0], res.tokens[1]] += 1
        depths.update(res.depths)
    assert len(depths) > 1  # the rule really varies the draft length
    assert chi2_pvalue(counts, joint) > ALPHA
