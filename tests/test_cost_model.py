"""The cost-aware default (plain decoding when speculation cannot pay), SpecDec++'s h from costs,
the step profile."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_speculative import tiny_llama

from draftsmith.runtime.acceptance.stop_policies import ConfidenceStop, FixedDepth
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import NullProposer
from draftsmith.runtime.drafting.chain import ChainProposer
from draftsmith.runtime.shapes import calibration, loop_profile, shape_cache
from draftsmith.runtime.shapes.cost_model import MachineCosts, choose_depth, threshold_from_costs

pytestmark = pytest.mark.unit

COSTS = MachineCosts(
    ar_step_ms=10.0,
    verify_ms={1: 10.0, 2: 10.5, 4: 11.5, 8: 14.0},
    draft_ms_per_depth=1.0,
    overhead_ms=0.5,
)


def test_choose_depth_on_known_numbers():
    # depth 1: 1.8 tokens / (1 + 10.5 + 0.5) ms * 10 = 1.5x; depth 2: 2.44 / 13.5 * 10 = 1.81x;
    # depth 3: 2.95 / 15 * 10
    choice = choose_depth([0.8, 0.64, 0.51], COSTS, nodes_for_depth=lambda k: {1: 2, 2: 3, 3: 4}[k])
    assert [round(r["speedup"], 3) for r in choice.table] == [1.0, 1.5, 1.807, 1.967]
    assert choice.depth == 3 and not choice.speculation_loses
    assert COSTS.verify_at(3) == pytest.approx(11.0) and COSTS.verify_at(10) == pytest.approx(15.25)


def test_a_never_agreeing_drafter_gets_plain_decoding_an_always_agreeing_one_speculation():
    never = choose_depth([0.0, 0.0, 0.0, 0.0], COSTS)
    assert never.depth == 0 and never.speculation_loses and "predicted to lose" in never.summary()
    always = choose_depth([1.0, 1.0, 1.0, 1.0], COSTS)
    assert always.depth == 4 and always.predicted_speedup > 2
    # a gain inside the prediction's error is not worth it
    assert choose_depth([0.12], COSTS, min_gain=0.03).depth == 0


def test_threshold_h_from_costs():
    # one more token costs (1 ms draft + 0.5 ms marginal verify) / 10 ms = 0.15 of a plain step: h =
    # 0.85
    assert threshold_from_costs(COSTS, nodes=1) == pytest.approx(0.85)
    dear = MachineCosts(10.0, {1: 10.0, 2: 19.0}, draft_ms_per_depth=5.0)
    assert threshold_from_costs(dear) == pytest.approx(0.05)  # clamped: drafting barely ever pays


class OracleDrafter:
    """A free chain drafter that knows the target's greedy continuation (``offset`` 0) or is always
    wrong (1)."""

    def __init__(self, sequence: list[int], vocab: int, offset: int) -> None:
        self.sequence, self.vocab, self.offset = sequence, vocab, offset

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        nxt = self.sequence[ids.numel()] if ids.numel() < len(self.sequence) else 0
        return (
            torch.nn.functional.one_hot(
                torch.tensor((nxt + self.offset) % self.vocab), self.vocab
            ).float()
            * 20
        )


@pytest.mark.parametrize("offset, expect_plain", [(1, True), (0, False)])
def test_cost_aware_default_on_measured_costs(offset, expect_plain, tmp_path, monkeypatch):
    from test_shape_choice import CostedModel, FakeClock

    monkeypatch.setenv("DRAFTSMITH_COST_CACHE", str(tmp_path))
    _, lean = tiny_llama(0, layers=4, head_scale=8.0)
    prompt = [1, 5, 9]
    sequence = prompt + generate_ar(lean, prompt, 120)
    clock = FakeClock()  # every forward charges it: 10 ms + 0.25 ms per new token, a 50 ms prefill
    costed = CostedModel(lean, clock, lambda n: 10.0 + 0.25 * n, prefill_ms=50.0)
    spec = SpeculativeDecoder(
        costed,
        ChainProposer(OracleDrafter(sequence, 96, offset), depth=4),
        stop_policy=ConfidenceStop(0.1, max_depth=4),
    )
    runtime = SimpleNamespace(
        speculative=spec, model=lean, eos_ids=(), folder="tiny", export_config={"method": "t"}
    )
    choice, record = calibration.choose_cost_aware_shape(runtime, [prompt, prompt], clock=clock)
    assert choice.speculation_loses == expect_plain
    assert record["ar_step_ms_decode_only"] == pytest.approx(10.25) and sorted(
        record["verify_ms_by_nodes"]
    ) == list(range(1, 17))
    assert (
        all(r["measured_speedup"] is not None for r in record["timed"])
        and len(record["timed"]) == 4
    )  # + plain
    if expect_plain:
        assert (
            isinstance(spec.proposer, NullProposer) and record["acceptance_by_position"][0] == 0.0
        )
        # plain decoding through the same loop
        assert spec.generate(prompt, 20).tokens == sequence[3:23]
    else:
        assert (
            isinstance(spec.stop_policy, ConfidenceStop)
            and spec.stop_policy.max_depth == choice.depth >= 1
        )
        assert choice.measured_speedup > 1.0 + choice.noise
    assert (tmp_path / f"{next(tmp_path.glob('*.json')).name}").is_file()
    fresh = SimpleNamespace(
        **{
            **vars(runtime),
            "speculative": SpeculativeDecoder(
                lean,
                ChainProposer(OracleDrafter(sequence, 96, offset), depth=4),
                stop_policy=FixedDepth(4),
            ),
        }
    )
    note = shape_cache.apply_cached_shape(
        fresh
    )  # generate reuses the decision measured by the bench
    assert ("plain decoding" in note) == expect_plain


def test_profile_parts_add_up_to_the_measured_step():
    _, lean = tiny_llama(0, layers=4, head_scale=8.0)
    prompt = [1, 5, 9]
    sequence = prompt + generate_ar(lean, prompt, 80)
    spec = SpeculativeDecoder(lean, ChainProposer(OracleDrafter(sequence, 96, 0), depth=3))
    report, results, _ = loop_profile.profiled_run(spec, [prompt, prompt], 60, ())
    assert report["steps"] == sum(r.steps for r in results) > 10
    parts = sum(
        report[f"{k}_ms"]
        for k in ("draft", "verify_forward", "verification", "kv_compaction", "proposer_update")
    )
    assert report["verify_forward_ms"] > 0 and report["draft_ms"] > 0
    assert abs(report["step_ms"] - parts) <= 0.1 * report["step_ms"]
    assert spec.profiler is None  # detached after the run
