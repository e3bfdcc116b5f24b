"""Hydra / Hydra++ heads: which drafted tokens each head sees, the runtime step API, training on a
tiny target."""

import head_family_utils
import pytest
import torch
from head_family_utils import fit_steps, fixed_batch, recipe_cfg

from draftsmith.common.errors import ConfigError
from draftsmith.heads.hydra import HydraConfig, HydraHeads

pytestmark = pytest.mark.unit

tiny_target = head_family_utils.tiny_target  # the shared module-scoped fixture


def coded_heads(**kw) -> HydraHeads:
    """Heads whose embedding of token v is the constant vector v, so a head's input reveals the
    tokens it read."""
    config = HydraConfig(hidden_size=4, vocab_size=20, num_heads=3, **kw)
    embed = torch.arange(20.0).unsqueeze(-1).expand(20, 4).contiguous()
    return HydraHeads(config, embed, torch.randn(20, 4))


def seen_tokens(heads: HydraHeads, k: int, run) -> list[list[int]]:
    """The tokens head k read in ``run()``: its input chunks after the hidden state, decoded."""
    captured = []
    hook = heads.heads[k].grounded.register_forward_pre_hook(
        lambda _m, args: captured.append(args[0])
    )
    try:
        run()
    finally:
        hook.remove()
    z = captured[0].reshape(-1, (k + 2) * 4)  # [rows, (k+2)H]
    return [[int(z[r, 4 * (j + 1)]) for j in range(k + 1)] for r in range(z.shape[0])]


def test_each_head_sees_the_tokens_before_it_on_a_hand_checked_path():
    heads = coded_heads()
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])  # x_0 .. x_5
    ctx = torch.randn(1, 6, 4)
    # Head 0 at t reads x_{t+1} (the root) and predicts x_{t+2}; rows t = 0..3.
    assert seen_tokens(heads, 0, lambda: heads.teacher_forced(ctx, ids, 0)) == [
        [11],
        [12],
        [13],
        [14],
    ]
    # Head 1 at t reads x_{t+1}, x_{t+2} and predicts x_{t+3}; rows t = 0..2.
    assert seen_tokens(heads, 1, lambda: heads.teacher_forced(ctx, ids, 1)) == [
        [11, 12],
        [12, 13],
        [13, 14],
    ]
    assert seen_tokens(heads, 2, lambda: heads.teacher_forced(ctx, ids, 2)) == [
        [11, 12, 13],
        [12, 13, 14],
    ]
    assert heads.teacher_forced(ctx, ids, 2).shape == (1, 2, 20)
    # Runtime: a frontier of two paths below root 11, at depth 1 (head 1 reads the root and head 0's
    # draft).
    prefix = torch.tensor([[11, 12], [11, 7]])
    assert seen_tokens(heads, 1, lambda: heads.step(ctx[0, :1].expand(2, 4), prefix)) == [
        [11, 12],
        [11, 7],
    ]


def test_the_step_api_equals_teacher_forcing_and_rejects_too_long_prefixes():
    heads = coded_heads(
        num_layers=2,
        prefix_layer=True,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=2,
        intermediate_size=8,
    )
    torch.manual_seed(0)
    for p in heads.parameters():
        p.data.normal_(0, 0.3)
    ids = torch.randint(0, 20, (2, 7))
    hidden = torch.randn(2, 7, 4)
    ctx, cache = heads.context(hidden)
    # The prefix layer's cache: the context in two chunks equals it in one.
    ctx_a, cache_a = heads.context(hidden[:, :4])
    ctx_b, _ = heads.context(hidden[:, 4:], cache=cache_a)
    torch.testing.assert_close(torch.cat([ctx_a, ctx_b], 1), ctx, rtol=1e-5, atol=1e-6)
    for k in range(3):
        forced = heads.teacher_forced(ctx, ids, k)  # [2, 7-k-2, V]
        t = 1
        stepped = heads.step(ctx[:, t], ids[:, t + 1 : t + 2 + k])
        torch.testing.assert_close(stepped, forced[:, t], rtol=1e-5, atol=1e-6)
        keep = torch.rand(forced.shape[:2]) > 0.5
        torch.testing.assert_close(
            heads.teacher_forced(ctx, ids, k, keep), forced[keep]
        )  # only the kept rows
    with pytest.raises(ValueError, match="asks for head 3; this export has 3 heads"):
        heads.step(ctx[:, 0], ids[:, :4])


def test_a_fresh_head_is_a_medusa_head_and_hydra_pp_starts_as_hydra():
    embed, lm = torch.randn(20, 4), torch.randn(20, 4)
    plain = HydraHeads(HydraConfig(hidden_size=4, vocab_size=20, num_heads=2), embed, lm)
    pp = HydraHeads(
        HydraConfig(
            hidden_size=4,
            vocab_size=20,
            num_heads=2,
            prefix_layer=True,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=2,
            intermediate_size=8,
        ),
        embed,
        lm,
    )
    hidden = torch.randn(1, 5, 4)
    ctx, _ = pp.context(hidden)
    torch.testing.assert_close(ctx, hidden)  # the prefix layer starts as the identity
    prefix = torch.tensor([[3, 4]])
    # Zero-initialised grounded weights, res = [I | 0]: head k starts as a fresh Medusa head (h +
    # SiLU(b), then the target LM head), whatever the prefix.
    bias = plain.heads[1].grounded.linear.bias
    torch.testing.assert_close(
        plain.step(hidden[:, 0], prefix), (hidden[:, 0] + torch.nn.functional.silu(bias)) @ lm.T
    )
    torch.testing.assert_close(
        plain.step(hidden[:, 0], prefix), plain.step(hidden[:, 0], torch.tensor([[9, 1]]))
    )


@pytest.mark.parametrize("name, labels", [("hydra", "dataset"), ("hydra_pp", "target_argmax")])
def test_loss_decreases_on_a_fixed_batch_and_the_export_tree_is_calibrated(
    name, labels, tiny_target
):
    from draftsmith.recipes import get_recipe

    # (Hydra++'s soft labels from a random tiny target are near uniform: a loss floor at the
    # teacher's entropy, so the decrease is checked on its hard greedy labels.)
    recipe = get_recipe(name)
    cfg = recipe_cfg(
        name,
        heads={"num_heads": 3, "num_layers": 2},
        inference={"tree_nodes": 6, "top_k": 3},
        distill={"labels": labels},
    )
    recipe.validate(cfg)
    objective = recipe.build(cfg, tiny_target)
    assert objective.export_config()["inference"]["tree_source"] == "default"
    batch = fixed_batch(tiny_target.vocab_size)
    losses = fit_steps(objective, tiny_target, batch, 12)
    assert losses[-1] < 0.8 * losses[0], losses
    # A validation pass counts per-rank agreement with the target; the export tree is built from it.
    objective.module.eval()
    objective.on_validation_start()
    with torch.no_grad():
        from dataclasses import replace

        objective.loss(
            batch,
            tiny_target.features(
                batch["input_ids"], batch["attention_mask"], replace(objective.taps, logits=True)
            ),
        )
    inference = objective.export_config()["inference"]
    assert inference["tree_source"] == "calibrated" and len(inference["tree"]) == 6
    assert len(inference["head_accuracies"]) == 3 and inference["verifier"] == "greedy"
    arch = objective.export_config()["architecture"]
    assert (
        arch["prefix_layer"] == (name == "hydra_pp") and objective.export_config()["method"] == name
    )


def test_bad_hydra_config_is_refused_before_the_target_loads():
    from draftsmith.recipes import get_recipe

    validate = get_recipe("hydra").validate
    with pytest.raises(ConfigError, match=r"heads\.num_layers=0 is out of range: allowed >= 1"):
        validate(recipe_cfg("hydra", heads={"num_layers": 0}))
    with pytest.raises(
        ConfigError, match=r"heads\.dropout=1\.5 is out of range: allowed >= 0 and < 1"
    ):
        validate(recipe_cfg("hydra", heads={"dropout": 1.5}))


def test_hydra_pp_soft_labels_are_a_cross_entropy_against_the_targets_distribution(tiny_target):
    from draftsmith.recipes import get_recipe

    cfg = recipe_cfg("hydra_pp", heads={"num_heads": 2, "num_layers": 1})
    objective = get_recipe("hydra_pp").build(cfg, tiny_target)
    assert objective.labels == "target_soft" and objective.taps.logits
    batch = fixed_batch(tiny_target.vocab_size)
    feats = tiny_target.features(batch["input_ids"], batch["attention_mask"], objective.taps)
    loss, _ = objective.loss(batch, feats)
    mask = (batch["loss_mask"] * batch["attention_mask"]).bool()
    entropy = -(feats.logits.softmax(-1) * feats.logits.log_softmax(-1)).sum(-1)  # [B, T]
    floor = sum(
        entropy[:, k + 1 : -1][mask[:, k + 2 :]].mean() for k in range(2)
    )  # soft CE >= teacher entropy
    assert floor.item() < loss.item() < floor.item() + 2.0
    loss.backward()
    # the prefix layer learns
    assert objective.module.prefix.self_attn.o_proj.weight.grad.abs().sum() > 0
