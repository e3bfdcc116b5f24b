"""Medusa's greedy optimal sparse tree from measured head accuracies (common/trees.py)."""

import pytest
import torch

from draftsmith.common.trees import HeadRankStats, calibrated_tree, expected_accept_length

pytestmark = pytest.mark.unit

# Head 0: top-1 right 60%, top-2 20%; head 1: 50% / 10%. Path values: (0) .6, (0,0) .3, (1) .2,
# (1,0) .1, (0,1) .06, (1,1) .02.
TABLE = [[0.6, 0.2], [0.5, 0.1]]


def test_the_calibrated_tree_on_a_known_table_is_the_known_tree():
    assert calibrated_tree(TABLE, 1) == [[0]]
    assert calibrated_tree(TABLE, 4) == [[0], [1], [0, 0], [1, 0]]
    assert calibrated_tree(TABLE, 5) == [[0], [1], [0, 0], [0, 1], [1, 0]]
    assert calibrated_tree(TABLE, 100) == [
        [0],
        [1],
        [0, 0],
        [0, 1],
        [1, 0],
        [1, 1],
    ]  # capped by the full tree
    assert expected_accept_length(calibrated_tree(TABLE, 4), TABLE) == pytest.approx(
        1 + 0.6 + 0.3 + 0.2 + 0.1
    )


def test_a_weak_second_head_makes_the_tree_wide_not_deep():
    wide = calibrated_tree([[0.3, 0.25, 0.2], [0.05, 0.01, 0.01]], 3)
    assert wide == [[0], [1], [2]]
    deep = calibrated_tree([[0.9, 0.02], [0.9, 0.02], [0.9, 0.02]], 3)
    assert deep == [[0], [0, 0], [0, 0, 0]]


def test_the_greedy_tree_is_optimal_against_every_other_tree_of_its_size():
    # Exhaustive check on a 3x2 table: no other prefix-closed set of 4 paths has a larger expected
    # length.
    from itertools import combinations, product

    table = [[0.55, 0.3], [0.6, 0.2], [0.4, 0.35]]
    paths = [list(p) for d in (1, 2, 3) for p in product(range(2), repeat=d)]
    best = max(
        expected_accept_length(list(c), table)
        for c in combinations(paths, 4)
        if all(len(p) == 1 or p[:-1] in c for p in c)
    )
    assert expected_accept_length(calibrated_tree(table, 4), table) == pytest.approx(best)


def test_rank_stats_count_each_rank_and_bad_tables_are_refused():
    stats = HeadRankStats(num_heads=2, top_k=2)
    assert stats.accuracies() is None
    logits = torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0], [1.0, 2.0, 3.0], [3.0, 1.0, 2.0]])
    stats.update(0, logits, torch.tensor([0, 1, 0, 1]))  # ranks 1, 2, 3, 3
    stats.update(1, logits[:2], torch.tensor([0, 0]))
    assert stats.accuracies().tolist() == [[0.25, 0.25], [1.0, 0.0]]
    stats.reset()
    assert stats.accuracies() is None
    with pytest.raises(ValueError, match=r"\[num_heads, top_k\]"):
        calibrated_tree([0.5, 0.2], 3)
    with pytest.raises(ValueError, match="probabilities"):
        calibrated_tree([[1.5]], 3)
