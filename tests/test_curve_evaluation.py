"""What the learning curve reads at each point: the per-position acceptance of recorded trees, a
real evaluation of a tiny export in the runtime's own loop with its cost-aware shape, and the share
of the target's tokens the draft vocabulary can draft."""

from __future__ import annotations

import math

import pytest
from pattern_target import write_heldout_prompts

from draftsmith.evals.learning_curve import (
    EvalSettings,
    chain_acceptance,
    conditional,
    cost_aware,
    coverage,
    draft_vocabulary,
    evaluate_export,
)
from draftsmith.runtime.shapes.cost_model import MachineCosts
from draftsmith.runtime.shapes.draft_shapes import RecordedStep

pytestmark = pytest.mark.unit


def _step(accepted_depth: int, depth: int = 4) -> RecordedStep:
    """A recorded chain of ``depth`` drafted nodes whose first ``accepted_depth`` were accepted."""
    parents = [-1, *range(depth)]
    return RecordedStep(
        parents, list(range(depth + 1)), [1.0] * (depth + 1), list(range(accepted_depth + 1))
    )


def test_chain_acceptance_is_cumulative_and_conditional_divides_it():
    steps = [_step(0), _step(1), _step(2), _step(4)]
    cumulative = chain_acceptance(steps)
    assert cumulative == [0.75, 0.5, 0.25, 0.25]
    assert conditional(cumulative) == pytest.approx([0.75, 2 / 3, 0.5, 1.0])


def test_evaluating_a_tiny_export_records_acceptance_by_position_and_a_cost_aware_shape(
    tmp_path, medusa_export
):
    prompts = write_heldout_prompts(tmp_path / "heldout.jsonl", count=2)
    settings = EvalSettings(prompt_sets=(str(prompts),), prompts=2, max_new_tokens=24, dtype="fp32")
    result, measured = evaluate_export(str(medusa_export), settings, measure=True)
    record = result[str(prompts)]
    assert (
        measured is not None
        and measured["costs"]["ar_step_ms"] > 0
        and "contended" in measured["contention"]
    )
    assert record["verify_steps"] > 0 and record["generated_tokens"] > 0
    cumulative = record["chain_acceptance"]
    assert len(cumulative) == 4 and all(a >= b for a, b in zip(cumulative, cumulative[1:]))
    assert record["first_position_acceptance"] == cumulative[0]
    assert record["chain_tau"]["chain:1"] == pytest.approx(1 + cumulative[0])
    costs = MachineCosts(**{**measured["costs"]})
    aware = cost_aware(record["shapes"], costs)
    labels = {r["shape"] for r in record["shapes"]}
    assert {
        "chain:1",
        "chain:2",
    } <= labels  # 2 heads: chains of 1 and 2 and aware["shape"] in labels | {"plain"}
    assert aware["predicted_speedup"] >= 1.0  # plain decoding (1.0) is always a candidate
    assert math.isfinite(aware["tau"]) and aware["tau"] >= 1.0


def test_draft_vocabulary_coverage_counts_tokens_the_drafter_cannot_draft(tmp_path):
    import torch
    from safetensors.torch import save_file

    from draftsmith.runtime.decoding.speculative import SpecResult

    save_file(
        {"d2t": torch.tensor([0, 4, 8])}, str(tmp_path / "model.safetensors")
    )  # draft ids 0,1,2 -> 0,5,10
    vocab = draft_vocabulary(str(tmp_path))
    assert vocab == {0, 5, 10}
    results = [SpecResult([0, 5, 7, 10], 4, [0] * 4, []), SpecResult([3], 1, [0], [])]
    assert coverage(results, vocab) == pytest.approx(3 / 5)
    assert coverage(results, None) is None
