"""tau and acceptance by position: one definition, shared by SpecResult and the bench."""

import pytest

from draftsmith.runtime.decoding import metrics

pytestmark = pytest.mark.unit


def test_tau_counts_the_bonus_token():
    assert (
        metrics.tau([0, 0, 0]) == 1.0 and metrics.tau([2, 0, 1]) == 2.0 and metrics.tau([]) == 0.0
    )


def test_acceptance_by_position_is_cumulative_over_steps_that_drafted_the_position():
    # depth-3 trees accepting 3, 1, 0; a depth-1 tree accepting 1 (it never drafted positions 2 and
    # 3)
    curve = metrics.acceptance_by_position([3, 1, 0, 1], [3, 3, 3, 1])
    assert curve == pytest.approx([3 / 4, 1 / 3, 1 / 3])
    assert metrics.acceptance_by_position([], []) == []
    with pytest.raises(ValueError, match="2 accepted counts vs 1 depths"):
        metrics.acceptance_by_position([1, 2], [3])


def test_pooling_per_prompt_steps_equals_the_definition_on_all_steps():
    prompts = [([2, 0], [2, 2]), ([1, 1, 2], [2, 2, 2])]
    pooled_acc = [a for acc, _ in prompts for a in acc]
    pooled_dep = [d for _, dep in prompts for d in dep]
    assert metrics.tau(pooled_acc) == pytest.approx(sum(a + 1 for a in pooled_acc) / 5)
    assert metrics.acceptance_by_position(pooled_acc, pooled_dep) == pytest.approx([4 / 5, 2 / 5])
