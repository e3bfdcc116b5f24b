"""Block-diffusion decoding: baseline vs Learn2PD vs EoTP on tiny in-process models and a scripted
toy LM."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_llama

from draftsmith.controllers.learn2pd import Learn2PDConfig, Learn2PDFilter
from draftsmith.runtime.decoding.diffusion import (
    DiffusionDecodeConfig,
    diffusion_decode,
    eotp_cut,
    filter_policy,
    learn2pd_policy,
    top_k_masked,
    transfer_schedule,
)
from draftsmith.runtime.target.diffusion_lm import DiffusionLM, DiffusionSpec

pytestmark = pytest.mark.unit

V, MASK, EOS = 12, 11, 2


class ScriptedLM:
    """A fake diffusion LM: slot j's prediction is ``answer[j]`` once slot j-1 is decided (or j
    opens a block), else the wrong token 8; slots listed in ``stuck`` are always wrong. Confidence
    falls with j."""

    def __init__(
        self, prompt_len: int, answer: list[int], L: int = 4, stuck: tuple[int, ...] = ()
    ) -> None:
        self.spec = DiffusionSpec(L, MASK)
        self.device, self.context, self.forwards = torch.device("cpu"), 4096, 0
        self.prompt_len, self.answer, self.stuck = prompt_len, answer, set(stuck)

    def eos_ids(self) -> tuple[int, ...]:
        return (EOS,)

    def forward(self, ids, blocks, cache=None, past_blocks=None, commit=False):
        self.forwards += 1
        T = ids.shape[1]
        logits = torch.zeros(1, T, V)
        for i in range(T):
            j = i + 1 - self.prompt_len  # the answer slot position i scores
            if not 0 <= j < len(self.answer):
                continue
            ready = j % self.spec.block_length == 0 or int(ids[0, i]) != MASK
            tok = self.answer[j] if ready and j not in self.stuck else 8
            logits[0, i, tok] = 10.0 - 0.1 * j
        return logits, cache


def tiny_lm(seed: int = 0) -> DiffusionLM:
    return DiffusionLM(
        build_tiny_llama(64, seed=seed), None, DiffusionSpec(block_length=8, mask_token_id=63)
    )


def reject_all() -> Learn2PDFilter:
    filt = Learn2PDFilter(Learn2PDConfig(block_length=8, threshold=0.5))
    torch.nn.init.constant_(filt.layers[-1].bias, -100.0)
    return filt


@pytest.mark.parametrize("temperature,cache", [(0.0, False), (0.0, True), (0.7, False)])
def test_always_reject_filter_equals_baseline(temperature, cache):
    lm = tiny_lm()
    cfg = DiffusionDecodeConfig(
        gen_length=24, steps_per_block=8, temperature=temperature, use_cache=cache, seed=3
    )
    prompt = [5, 9, 17, 4, 30]
    base = diffusion_decode(lm, prompt, cfg)
    learned = diffusion_decode(lm, prompt, cfg, policy=learn2pd_policy(reject_all()))
    assert learned.tokens == base.tokens and learned.steps == base.steps == 24


def test_prefix_cache_decodes_the_same_tokens():
    lm = tiny_lm(1)
    cfg = DiffusionDecodeConfig(gen_length=24, steps_per_block=4)
    plain = diffusion_decode(lm, [7, 8, 9], cfg)
    cached = diffusion_decode(
        lm, [7, 8, 9], DiffusionDecodeConfig(gen_length=24, steps_per_block=4, use_cache=True)
    )
    assert plain.tokens == cached.tokens
    # prompt + one commit per finished block but the last
    assert cached.forwards == cached.steps + 1 + 2


def test_filter_never_commits_fewer_than_baseline():
    lm = tiny_lm(2)
    torch.manual_seed(0)
    filt = Learn2PDFilter(
        Learn2PDConfig(block_length=8, threshold=0.5)
    )  # random: accepts some slots
    inner = learn2pd_policy(filt)
    seen = []

    def spy(step, masked, x0, conf, k):
        commit = inner(step, masked, x0, conf, k)
        assert torch.all(commit[top_k_masked(masked, conf, k)])  # the baseline's top-k is always in
        seen.append((int((commit & masked).sum()), min(k, int(masked.sum()))))
        return commit

    cfg = DiffusionDecodeConfig(gen_length=24, steps_per_block=8)
    learned = diffusion_decode(lm, [3, 4, 5, 6], cfg, policy=spy)
    base = diffusion_decode(lm, [3, 4, 5, 6], cfg)
    assert all(n >= k for n, k in seen)
    assert all(a <= b for a, b in zip(learned.block_steps, base.block_steps))
    for _ in range(50):  # and on random confidences, k included
        masked, conf = torch.rand(8) < 0.6, torch.rand(8)
        k = int(torch.randint(1, 4, ()))
        commit = filter_policy(lambda c: torch.rand(8) < 0.3)(0, masked, None, conf, k)
        assert int((commit & masked).sum()) >= min(k, int(masked.sum()))


def test_transfer_schedule_spreads_masks():
    assert transfer_schedule(32, 32) == [1] * 32
    assert transfer_schedule(10, 4) == [3, 3, 2, 2]


def test_eotp_cut_rules():
    eos = torch.tensor([EOS])
    x0 = torch.tensor([5, EOS, 6, EOS])
    conf = torch.tensor([0.9, 0.5, 0.4, 0.8])
    masked = torch.tensor([True, True, True, True])
    assert eotp_cut(torch.tensor([False, True, False, True]), masked, x0, conf, eos) == (
        1,
        True,
    )  # first committed
    assert eotp_cut(torch.tensor([True, False, False, False]), masked, x0, conf, eos) == (
        3,
        False,
    )  # most confident
    assert eotp_cut(
        torch.zeros(4, dtype=torch.bool), masked, torch.tensor([5, 6, 7, 8]), conf, eos
    ) == (None, False)


def test_eotp_truncates_and_skips_later_blocks():
    answer = [5, 6, 7, EOS] + [EOS] * 12
    lm = ScriptedLM(prompt_len=3, answer=answer)
    cfg = DiffusionDecodeConfig(gen_length=16, steps_per_block=4)
    base = diffusion_decode(lm, [1, 1, 1], cfg)
    assert base.tokens == answer and base.steps == 16 and base.answer == [5, 6, 7]
    cut = diffusion_decode(
        lm, [1, 1, 1], DiffusionDecodeConfig(gen_length=16, steps_per_block=4, eotp=True)
    )
    assert cut.answer == [5, 6, 7] and cut.truncated_at == 3 and len(cut.block_steps) == 1
    assert cut.tokens == [5, 6, 7, EOS] and cut.steps < base.steps


def test_oracle_labels_on_toy_trajectory():
    from draftsmith.datagen.trajectories import oracle_trace

    answer = [5, 6, 7, 9, 4, 4, 5, 6]
    lm = ScriptedLM(prompt_len=2, answer=answer, stuck=(5,))
    trace = oracle_trace(
        lm, [1, 1], DiffusionDecodeConfig(gen_length=8, steps_per_block=4), reference=answer
    )
    # Block 0: each step only the next slot's prediction is right; the oracle commits it, so 4
    # steps. Block 1: slot 4 right at step 0; slot 5 is stuck wrong, so step 2 sees no change and
    # copies the reference.
    expected = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0]]
    assert trace.labels.tolist() == expected
    assert trace.steps.tolist() == [0, 1, 2, 3, 0, 1]
    assert trace.conf.shape == (6, 4)


def test_prompt_longer_than_context_is_refused():
    lm = tiny_lm()
    with pytest.raises(
        ValueError, match="context is 512 positions; shorten the prompt to at most 488"
    ):
        diffusion_decode(
            lm, list(range(500)), DiffusionDecodeConfig(gen_length=24, steps_per_block=8)
        )
    assert lm.forwards == 0
