"""DFlash's served confidence cut: the cut search picks the cut with the most accepted tokens per
verify cost, and a trained confidence head is exported with the cut validation picked (an explicit
cut is served as given)."""

from __future__ import annotations

import pytest
import torch
from dflash_exports import tiny_llama_target
from omegaconf import OmegaConf
from recipe_configs import recipe_config

pytestmark = pytest.mark.unit


def test_cut_search_picks_the_cut_with_the_most_accepted_tokens_per_verify_cost():
    from draftsmith.recipes.dflash.cut import CutSearch, drafted_per_cut

    confidence = torch.tensor(
        [[0.9, 0.9, 0.1, 0.1], [0.9, 0.9, 0.9, 0.9]]
    )  # cumulative: .9 .81 .081 .0081 / ...
    scored = torch.tensor([4, 3])
    assert drafted_per_cut(confidence, scored, torch.tensor([0.0, 0.5, 0.95])).tolist() == [
        [4, 3],
        [3, 3],
        [1, 1],
    ]
    search = CutSearch(token_cost=0.5)
    search.add(
        confidence, scored, accepted=torch.tensor([2, 3])
    )  # block 1's slots 3-4 would be rejected
    cut, speed = search.best()
    assert cut == 0.1 and speed == pytest.approx(
        (2 + 5) / (2 + 0.5 * 6)
    )  # 3 then 3 slots verified, 2 + 3 kept
    free = CutSearch(token_cost=0.0)  # verifying costs nothing: never cut
    free.add(confidence, scored, torch.tensor([2, 3]))
    assert free.best()[0] == 0.0 and CutSearch(0.1).best() is None


def test_a_trained_dflash_confidence_head_serves_at_the_cut_validation_picked(tiny_tokenizer):
    from draftsmith.recipes.dflash.build import build_objective

    target = tiny_llama_target(tiny_tokenizer)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, target.vocab_size, (2, 20), generator=g)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
    }
    assert recipe_config("dflash").inference.cut is None  # the default: chosen by validation

    def build(**extra):
        cfg = recipe_config(
            "dflash",
            OmegaConf.merge(
                {
                    "drafter": {
                        "target_layers": [1, 2, 3],
                        "block_size": 4,
                        "mask_token_id": 1,
                        "confidence_head": True,
                    }
                },
                extra,
            ),
        )
        torch.manual_seed(0)
        return build_objective(cfg, target, [(ids, batch["loss_mask"])])

    objective = build(
        inference={"cut_token_cost": 5.0}
    )  # a drafted token costing 5 steps: cutting pays
    feats = target.features(ids, batch["attention_mask"], objective.taps)
    objective.module.eval()
    objective.on_validation_start()
    with torch.no_grad():
        objective.loss(batch, feats)
    expected = objective.cut_search.best()
    objective.on_validation_end()
    assert expected is not None and objective.export_config()["inference"]["cut"] == expected[0] > 0
    fixed = build(inference={"cut": 0.0})  # an explicit cut is served as given, never searched
    assert fixed.cut_search is None and fixed.export_config()["inference"]["cut"] == 0.0
