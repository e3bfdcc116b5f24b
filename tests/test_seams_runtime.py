"""The runtime's typed seams: one forward result, one step context, per-position temperatures in the
sampler."""

from __future__ import annotations

import pytest
import torch
from test_speculative import tiny_llama
from test_speculative_sampling import ALPHA, SMALL_V, bigram_drafter, chi2_pvalue

from draftsmith.runtime.acceptance.rejection_sampling import RejectionSamplingVerifier
from draftsmith.runtime.acceptance.verifiers import GreedyVerifier, target_probs
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import NullProposer, StepContext
from draftsmith.runtime.drafting.chain import ChainProposer, SampledTreeProposer
from draftsmith.runtime.target.output import TargetOutput

pytestmark = pytest.mark.unit


def test_one_forward_result_carries_logits_hidden_and_requested_taps():
    _, lean = tiny_llama(0, layers=3)
    ids = torch.tensor([4, 8, 15, 16])
    plain = lean.forward(ids, lean.allocate_cache(8))
    tapped = lean.forward(ids, lean.allocate_cache(8), taps=(2, 0))
    assert isinstance(plain, TargetOutput) and plain.taps == {}
    torch.testing.assert_close(tapped.logits, plain.logits)  # asking for taps changes nothing else
    assert sorted(tapped.taps) == [0, 2]
    torch.testing.assert_close(
        tapped.taps[0], lean.embed_tokens(ids)
    )  # layer 0's input = the embeddings
    feats = tapped.tap_features((2, 0))  # [T, 2H] in the order asked
    torch.testing.assert_close(feats, torch.cat([tapped.taps[2], tapped.taps[0]], -1))
    assert plain.tap_features(()) is None
    with pytest.raises(ValueError, match=r"taps \[4\] outside 0..3"):
        lean.forward(ids, lean.allocate_cache(8), taps=(4,))


class Recorder(NullProposer):
    """Records the context of every event; reads the target's layer 1 taps."""

    feature_taps = (1,)

    def __init__(self) -> None:
        self.events: list[tuple[str, StepContext]] = []

    def begin(self, ctx: StepContext) -> None:
        self.events.append(("begin", ctx))

    def propose(self, ctx: StepContext):
        self.events.append(("propose", ctx))
        return super().propose(ctx)

    def accept(self, ctx: StepContext) -> None:
        self.events.append(("accept", ctx))


def test_every_proposer_event_gets_one_step_context_with_the_documented_rows():
    _, lean = tiny_llama(0)
    recorder, prompt = Recorder(), [1, 5, 9, 2]
    out = SpeculativeDecoder(lean, recorder).generate(prompt, 3).tokens
    kinds = [k for k, _ in recorder.events]
    assert kinds == ["begin", "propose", "accept", "propose", "accept"]
    begin = recorder.events[0][1]
    h = lean.config.hidden_size
    assert begin.tokens.tolist() == prompt + out[:1] and begin.root_token == out[0]
    assert (
        begin.hidden.shape == (4, h) and begin.taps.shape == (4, h) and begin.logits.shape[0] == 1
    )
    ref = lean.forward(torch.tensor(prompt), lean.allocate_cache(8), taps=(1,))
    torch.testing.assert_close(begin.taps, ref.taps[1])
    propose, accept = recorder.events[1][1], recorder.events[2][1]
    assert (
        propose.hidden.shape == (h,) and propose.root_token == out[0] and propose.acceptance is None
    )
    assert accept.acceptance is not None and accept.acceptance.bonus_token == out[1]
    assert (
        accept.hidden.shape == (1, h)
        and accept.taps.shape == (1, h)
        and accept.logits.shape[0] == 1
    )


def test_target_probs_takes_one_temperature_per_row():
    logits = torch.tensor([[2.0, 1.0, 0.5], [0.1, 3.0, 0.2], [1.0, 1.0, 4.0]])
    probs = target_probs(logits, torch.tensor([1.0, 0.0, 0.5]))
    torch.testing.assert_close(probs[0], torch.softmax(logits[0].double(), -1))
    assert probs[1].tolist() == [0.0, 1.0, 0.0]  # temperature 0: the argmax as a point mass
    torch.testing.assert_close(probs[2], torch.softmax(logits[2].double() / 0.5, -1))
    with pytest.raises(ValueError, match="shape"):
        target_probs(logits, torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match=">= 0"):
        target_probs(logits, torch.tensor([1.0, -1.0, 1.0]))


def test_a_temperature_policy_needs_a_sampling_verifier():
    _, lean = tiny_llama(0)
    with pytest.raises(ValueError, match="verifier=rejection"):
        SpeculativeDecoder(
            lean, NullProposer(), GreedyVerifier(), temperature_policy=lambda h: torch.zeros(len(h))
        )


# thousands of whole sampled decodes for a chi-square: over 5 s, so not in the unit tier
@pytest.mark.e2e
def test_speculative_sampling_at_per_position_temperatures_keeps_the_adaptive_law():
    """A temperature chosen from the target's hidden at each position (greedy at some, T=1.3 at
    others): speculative sampling must emit (t1, t2) with exactly the law of sampling each position
    at its own temperature.
    """
    hf, lean = tiny_llama(3, vocab=SMALL_V, hidden=32, layers=1, head_scale=10.0)
    prompt = [1, 2, 3]
    with torch.no_grad():
        first = hf(torch.tensor([prompt]), output_hidden_states=True)
        ctx2 = torch.tensor([prompt + [a] for a in range(SMALL_V)])
        second = hf(ctx2, output_hidden_states=True)
    h1, h2 = (
        first.hidden_states[-1][0, -1],
        second.hidden_states[-1][:, -1],
    )  # post-norm hidden [H], [V, H]
    # Split the 8 second-step contexts in half by hidden[0] (a threshold between two well-separated
    # values).
    values = h2[:, 0].sort().values
    gap = int((values[1:] - values[:-1])[2:5].argmax()) + 2
    threshold = float((values[gap] + values[gap + 1]) / 2)

    def policy(hidden: torch.Tensor) -> torch.Tensor:
        return torch.where(hidden[:, 0].float() > threshold, 0.0, 1.3)  # [T]

    t1_law = target_probs(first.logits[0, -1], policy(h1[None])[0])  # [V]
    t2_law = target_probs(second.logits[:, -1], policy(h2))  # [V, V]
    exact = t1_law[:, None] * t2_law
    assert 0 < int((policy(h2) == 0).sum()) < SMALL_V  # both kinds of position occur
    for proposer in (
        SampledTreeProposer(bigram_drafter(0), (2, 2), temperature=1.0),
        ChainProposer(bigram_drafter(1), depth=2),
    ):
        dec = SpeculativeDecoder(
            lean, proposer, RejectionSamplingVerifier(temperature=1.0), temperature_policy=policy
        )
        counts, gen = torch.zeros(SMALL_V, SMALL_V), torch.Generator().manual_seed(0)
        for _ in range(2500):
            a, b = dec.generate(prompt, 2, generator=gen).tokens
            counts[a, b] += 1
        assert float(counts[exact == 0].sum()) == 0  # greedy positions never deviate
        assert chi2_pvalue(counts, exact) > ALPHA
