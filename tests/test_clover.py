"""Clover-2: the regressive connection run step by step equals the batched training path; init;
training."""

import head_family_utils
import pytest
import torch
from head_family_utils import fit_steps, fixed_batch, recipe_cfg

from draftsmith.common.errors import ConfigError
from draftsmith.heads.clover import CloverConfig, CloverHeads

pytestmark = pytest.mark.unit

tiny_target = head_family_utils.tiny_target  # the shared module-scoped fixture


def random_clover(num_heads: int = 4) -> CloverHeads:
    config = CloverConfig(
        hidden_size=8,
        vocab_size=30,
        intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        num_heads=num_heads,
        num_layers=2,
    )
    torch.manual_seed(0)
    heads = CloverHeads(config, torch.randn(30, 8), torch.randn(30, 8))
    for p in heads.parameters():
        p.data.normal_(
            0, 0.3
        )  # away from the near-identity init, so a wrong token or state would show
    return heads.eval()


def test_the_regressive_connection_equals_running_it_step_by_step():
    heads = random_clover()
    ids = torch.randint(0, 30, (2, 9))
    prenorm = torch.randn(2, 8, 8)  # pairs t = 0..7 read (p_t, x_{t+1})
    c, _ = heads.context(prenorm, ids[:, 1:])
    batched = heads.teacher_forced(c, ids)
    assert [o.shape[1] for o in batched] == [
        7,
        6,
        5,
        4,
    ]  # head i has a label x_{t+i+2} for t < T-2-i
    for t in (0, 3):
        state, out, logits = heads.first(c[:, t])
        torch.testing.assert_close(out, batched[0][:, t], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logits, heads.logits(batched[0][:, t]))
        for i in range(1, 4):
            state, out, _ = heads.step(
                state, ids[:, t + i + 1]
            )  # the token head i-1 drafted: x_{t+i+1}
            torch.testing.assert_close(out, batched[i][:, t], rtol=1e-5, atol=1e-6)
    # Feeding another token changes the next head's output: the connection is really regressive.
    state, _, _ = heads.first(c[:, 0])
    _, a, _ = heads.step(state, ids[:, 2])
    _, b, _ = heads.step(state, (ids[:, 2] + 1) % 30)
    assert not torch.allclose(a, b)


def test_the_context_cache_in_chunks_equals_one_pass():
    heads = random_clover()
    ids = torch.randint(0, 30, (1, 8))
    prenorm = torch.randn(1, 8, 8)
    full, _ = heads.context(prenorm, ids)
    first, caches = heads.context(prenorm[:, :5], ids[:, :5])
    rest, caches = heads.context(prenorm[:, 5:], ids[:, 5:], caches=caches)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, rtol=1e-5, atol=1e-6)
    assert len(caches) == 2 and caches[0].length == 8


def test_clover2_starts_from_the_targets_last_layer_and_its_loss_decreases(tiny_target):
    from draftsmith.recipes import get_recipe

    recipe = get_recipe("clover2")
    cfg = recipe_cfg(
        "clover2", heads={"num_heads": 3, "num_layers": 1}, inference={"tree_nodes": 6, "top_k": 3}
    )
    recipe.validate(cfg)
    objective = recipe.build(cfg, tiny_target)
    last = tiny_target.model.model.layers[-1]
    assert torch.equal(
        objective.module.layers[0].self_attn.q_proj.weight, last.self_attn.q_proj.weight
    )
    assert torch.equal(objective.module.norm.weight, tiny_target.model.model.norm.weight)
    assert not any(
        k.startswith(("embed_weight", "lm_head_weight")) for k in objective.module.state_dict()
    )
    batch = fixed_batch(tiny_target.vocab_size)
    losses = fit_steps(objective, tiny_target, batch, 10)
    # The soft CE cannot go below the teacher's entropy (near uniform for a random tiny target):
    # compare above it.
    feats = tiny_target.features(batch["input_ids"], batch["attention_mask"], objective.taps)
    mask = (batch["loss_mask"] * batch["attention_mask"]).bool()
    entropy = -(feats.logits.softmax(-1) * feats.logits.log_softmax(-1)).sum(-1)  # [B, T]
    length = batch["input_ids"].shape[1]
    floor = sum(
        0.7**i * entropy[:, i + 1 : length - 1][mask[:, i + 2 :]].mean().item() for i in range(3)
    )
    assert losses[-1] - floor < 0.7 * (losses[0] - floor), (losses, floor)
    config = objective.export_config()
    assert config["method"] == "clover2" and config["inference"]["tree_source"] == "default"
    assert config["architecture"]["num_heads"] == 3


def test_bad_clover_config_is_refused_before_the_target_loads():
    from draftsmith.recipes import get_recipe

    validate = get_recipe("clover2").validate
    with pytest.raises(
        ConfigError,
        match=r"heads\.embed_source=nope is out of range: allowed one of embed, lm_head",
    ):
        validate(recipe_cfg("clover2", heads={"embed_source": "nope"}))
    with pytest.raises(ConfigError, match="must not both be 0"):
        validate(recipe_cfg("clover2", heads={"feature_weight": 0, "token_weight": 0}))
