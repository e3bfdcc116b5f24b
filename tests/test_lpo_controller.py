"""The adaptive-temperature controller: grid checks, the runtime policy adapter, and LPO learning a
synthetic preference (T=0 on one prompt kind, T=1 on the other) through the recipe's objective."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from recipe_configs import recipe_config

from draftsmith.controllers.adaptive_temperature import (
    DEFAULT_GRID,
    AdaptiveTemperatureConfig,
    AdaptiveTemperatureHead,
    TemperaturePolicy,
    check_grid,
)
from draftsmith.export.format import write_export
from draftsmith.recipes.adaptive_temperature.objective import AdaptiveTemperatureObjective

pytestmark = pytest.mark.unit

H = 16


@pytest.mark.parametrize(
    "grid, message",
    [
        ([], "grid is empty"),
        ([0.0, -0.2], r"finite and >= 0.*-0.2"),
        ([0.0, float("nan")], "finite and >= 0"),
        ([0.2, 0.2], "repeats"),
        (["hot"], "list of numbers"),
    ],
)
def test_bad_grids_are_named(grid, message):
    with pytest.raises(ValueError, match=message):
        check_grid(grid)
    with pytest.raises(ValueError, match=message):
        AdaptiveTemperatureConfig(hidden_size=H, grid=grid)


def test_blocks_are_independent_and_an_untrained_head_is_uniform():
    head = AdaptiveTemperatureHead(AdaptiveTemperatureConfig(hidden_size=H, num_layers=3, width=8))
    weights = [b[0].weight for b in head.blocks]
    assert len({id(w) for w in weights}) == 3 and not torch.equal(weights[1], weights[2])
    logp = head.log_probs(torch.randn(5, H))
    torch.testing.assert_close(
        logp.exp(), torch.full((5, len(DEFAULT_GRID)), 1 / len(DEFAULT_GRID))
    )


def test_policy_token_answers_every_row_sequence_keeps_the_first_choice(tmp_path):
    head = AdaptiveTemperatureHead(
        AdaptiveTemperatureConfig(hidden_size=H, granularity="sequence", num_layers=0)
    )
    with torch.no_grad():
        head.out.weight[:, 0] = torch.linspace(
            -1, 1, len(DEFAULT_GRID)
        )  # the choice follows the normed hidden[0]
    up, down = torch.zeros(1, H), torch.zeros(1, H)
    up[0, 0], down[0, 0] = 5.0, -5.0
    seq = TemperaturePolicy(head)
    assert seq(up).tolist() == [1.0] and seq(torch.cat([down, down])).tolist() == [
        1.0,
        1.0,
    ]  # kept for the response
    seq.reset()
    assert seq(down).tolist() == [0.0]
    tok = TemperaturePolicy(head, granularity="token")
    assert tok(torch.cat([up, down, up])).tolist() == [1.0, 0.0, 1.0]
    config = {
        "method": "adaptive_temperature",
        "architecture": head.architecture(),
        "inference": {},
        "target": {"name_or_path": "tiny"},
    }
    loaded, _ = AdaptiveTemperatureHead.from_export(
        write_export(tmp_path / "export", head.state_dict(), config)
    )
    torch.testing.assert_close(loaded(up), head(up))
    with pytest.raises(ValueError, match="choice mode"):
        TemperaturePolicy(head, mode="best")


def synthetic_batch(granularity: str, pairs: int, seed: int) -> tuple[dict, SimpleNamespace]:
    """Pairs drawn by the uniform first-round decoder; reward prefers T=0 on kind 0 and T=1 on kind
    1."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(2, H, generator=g) * 2
    kinds = torch.arange(pairs) % 2
    T, prompt = 5, 2  # positions 1..3 generate the 3 response tokens, position 4 is the last token
    hidden = centers[kinds][:, None] + 0.3 * torch.randn(pairs, T, H, generator=g)  # [P, T, H]
    best = torch.where(kinds == 0, 0.0, 1.0)
    k = len(DEFAULT_GRID)
    grid = torch.tensor(DEFAULT_GRID)
    if granularity == "sequence":
        a, b = (
            torch.randint(k, (pairs, 1), generator=g).expand(pairs, 3),
            torch.randint(k, (pairs, 1), generator=g),
        )
        b = b.expand(pairs, 3)
    else:
        a, b = torch.randint(k, (pairs, 3), generator=g), torch.randint(k, (pairs, 3), generator=g)
    ra, rb = -(grid[a] - best[:, None]).abs().mean(1), -(grid[b] - best[:, None]).abs().mean(1)
    keep = ra != rb
    chosen, rejected = (
        torch.where((ra > rb)[:, None], a, b)[keep],
        torch.where((ra > rb)[:, None], b, a)[keep],
    )
    n = int(keep.sum())
    index = torch.full((2 * n, T), -1)
    index[:, prompt - 1 : prompt + 2] = torch.cat([chosen, rejected])
    batch = {
        "choice_index": index,
        "first": torch.full((2 * n,), prompt - 1),
        "kind": kinds[keep].repeat(2),
        "input_ids": torch.zeros(2 * n, T, dtype=torch.long),
    }
    return batch, SimpleNamespace(final_hidden=hidden[keep].repeat(2, 1, 1), logits=None), centers


@pytest.mark.parametrize("granularity", ["sequence", "token"])
def test_lpo_learns_greedy_for_one_kind_and_t1_for_the_other(granularity):
    torch.manual_seed(0)
    batch, feats, centers = synthetic_batch(granularity, 96, seed=1)
    head = AdaptiveTemperatureHead(
        AdaptiveTemperatureConfig(hidden_size=H, granularity=granularity, width=32)
    )
    objective = AdaptiveTemperatureObjective(head, "separate", beta=1.0)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    losses = []
    for _ in range(150):
        loss, metrics = objective.loss(batch, feats)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0]
    assert float(metrics["temp_kind0"]) < 0.2 and float(metrics["temp_kind1"]) > 0.8
    policy = TemperaturePolicy(head.eval(), granularity="token")
    fresh = centers[:, None] + 0.3 * torch.randn(2, 20, H)  # unseen prompts of each kind
    assert policy(fresh[0]).tolist() == [0.0] * 20 and policy(fresh[1]).tolist() == [1.0] * 20


def test_recipe_refuses_bad_config_before_loading_the_target(tmp_path):
    from draftsmith.common.errors import ConfigError, DataError
    from draftsmith.recipes import get_recipe

    validate = get_recipe("adaptive_temperature").validate

    folder = tmp_path / "roll"
    folder.mkdir()
    (folder / "meta.json").write_text('{"grid": [0.0, 1.0], "granularity": "token"}')
    row = (
        '{"prompt_ids": [1, 2], "kind": "a", "samples": [{"tokens": [3], "temps": [0], "reward":'
        ' 1.0}, {"tokens": [4], "temps": [1], "reward": 0.0}], "chosen": %s, "rejected": %s}\n'
    )
    (folder / "rollouts.jsonl").write_text(row % ("null", "null"))

    def cfg(**over):
        base = {
            "controller": {"granularity": "token", "grid": None},
            "lpo": {"form": "separate", "beta": 1.0},
            "data": {"spec": str(folder)},
        }
        return recipe_config("adaptive_temperature", OmegaConf.merge(base, over))

    with pytest.raises(DataError, match="no chosen/rejected pairs"):
        validate(cfg())
    (folder / "rollouts.jsonl").write_text(row % (0, 1))
    validate(cfg())
    with pytest.raises(ConfigError, match="differs from the grid the rollouts were sampled on"):
        validate(cfg(controller={"grid": [0.0, 0.5]}))
    with pytest.raises(ConfigError, match="grid is empty"):
        validate(cfg(controller={"grid": []}))
    with pytest.raises(ConfigError, match="token-level rollouts"):
        validate(cfg(controller={"granularity": "sequence"}))
    with pytest.raises(ConfigError, match="lpo.form"):
        validate(cfg(lpo={"form": "ipo"}))
    with pytest.raises(DataError, match="does not exist"):
        validate(cfg(data={"spec": str(tmp_path / "missing")}))
