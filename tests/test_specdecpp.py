"""SpecDec++: acceptance labels, the weighted soft BCE, training states that equal the runtime's,
exports stacked on their drafter, lossless greedy decoding with every stop policy and bad input
(the stop rule's exact step and exact rejection sampling under it: test_specdecpp_stop_rule.py;
calibration: test_specdecpp_calibration.py)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_llama
from recipe_configs import recipe_config
from test_eagle_runtime import lean_from_hf, plain_greedy
from test_specdecpp_stop_rule import ScriptedHead

from draftsmith.common.errors import ConfigError
from draftsmith.controllers.acceptance import (
    AcceptanceHead,
    AcceptanceHeadConfig,
    acceptance_labels,
    base_export_dir,
    weighted_soft_bce,
)
from draftsmith.distill.target.frozen import Target
from draftsmith.drafters.eagle import EagleConfig, EagleDrafter
from draftsmith.export.format import ExportError, write_export
from draftsmith.recipes import get_recipe
from draftsmith.recipes.specdecpp import SpecDecPP
from draftsmith.recipes.specdecpp import objective as specdecpp
from draftsmith.runtime.acceptance.choice import choose_stop_policy, parse_stop_policy
from draftsmith.runtime.acceptance.stop_policies import LearnedStop
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.registry import build_proposer
from draftsmith.runtime.drafting.specdecpp import LearnedStopProposer

pytestmark = pytest.mark.unit

PROMPTS = [[5, 9, 13, 40], [7, 60, 61]]
NEW = 24


# ---- labels, loss, head --------------------------------------------------------------------------


def test_labels_on_a_toy_pair_are_min_one_p_over_q():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]])
    q = torch.tensor([[0.25, 0.6, 0.1, 0.05], [0.4, 0.4, 0.1, 0.1]])
    for tok in range(4):
        tokens = torch.tensor([tok, tok])
        want = torch.minimum(torch.ones(2), p[:, tok] / q[:, tok])
        torch.testing.assert_close(acceptance_labels(p, q, tokens), want)
    assert acceptance_labels(p, q, torch.tensor([0, 3])).tolist() == pytest.approx([1.0, 1.0])
    assert acceptance_labels(p, q, torch.tensor([1, 0])).tolist() == pytest.approx([0.5, 0.25])


def test_weighted_soft_bce_matches_the_two_class_reference_in_value_and_gradient():
    torch.manual_seed(0)
    z = torch.randn(7, requires_grad=True)
    label = torch.rand(7)
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0.0])
    w = 6.0
    loss = weighted_soft_bce(z, label, w, mask)
    # The reference's form: class logits [reject, accept] = [z, 0], CE weighted by [w, 1] and the
    # soft label.
    z_ref = z.detach().clone().requires_grad_(True)
    logits = torch.stack([z_ref, torch.zeros_like(z_ref)], -1)
    ce0 = F.cross_entropy(logits, torch.zeros(7, dtype=torch.long), reduction="none")
    ce1 = F.cross_entropy(logits, torch.ones(7, dtype=torch.long), reduction="none")
    ref = ((ce0 * w * (1 - label) + ce1 * label) * mask).sum() / (
        w * ((1 - label) * mask).sum() + (label * mask).sum()
    )
    torch.testing.assert_close(loss, ref)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(z.grad, z_ref.grad)


def test_head_blocks_are_independent_not_one_block_repeated():
    head = AcceptanceHead(AcceptanceHeadConfig(hidden_size=16, num_layers=3))
    ptrs = {b.linear.weight.data_ptr() for b in head.blocks}
    assert len(ptrs) == 3
    assert sum(p.numel() for p in head.parameters()) == 3 * (16 * 16 + 16) + 16 + 1
    assert head(torch.zeros(5, 16)).shape == (5,)


# ---- training on a tiny target -------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(tiny_tokenizer):
    hf = build_tiny_llama(len(tiny_tokenizer), initializer_range=0.2)
    return Target(hf, tiny_tokenizer, "tiny"), lean_from_hf(hf)


@pytest.fixture(scope="module")
def reference(target):
    return {tuple(p): plain_greedy(target[1], p, NEW) for p in PROMPTS}


def eagle_export(tgt: Target, lean, folder: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    arch = EagleConfig(**EagleConfig.dims_from_hf(tgt.config))
    drafter = EagleDrafter(arch, lean.embed_weight, lean.lm_head_weight)
    config = {
        "method": "eagle",
        "architecture": asdict(arch),
        "target": tgt.identity(),
        "inference": {"proposer": "chain", "depth": 4, "verifier": "greedy"},
    }
    return write_export(folder, drafter.state_dict(), config)


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory):
    tgt, lean = target
    return [
        eagle_export(tgt, lean, tmp_path_factory.mktemp(f"eagle{i}") / "export", i) for i in (0, 1)
    ]


def recipe_cfg(drafter: Path | None, inference: dict | None = None, **head) -> SpecDecPP:
    return recipe_config(
        "specdecpp",
        {
            "drafter": None if drafter is None else str(drafter),
            "head": head,
            "inference": inference or {},
        },
    )


def greedy_batch(reference):
    seqs = [p + reference[tuple(p)] for p in PROMPTS]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [1] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": attn.clone()}


@pytest.fixture(scope="module")
def trained(target, reference, drafters, tmp_path_factory):
    """A head trained briefly (fixed batch) on drafter 0, its losses, and its export."""
    tgt, _ = target
    cfg = recipe_cfg(drafters[0], temperature=1.0, mixing_ratio=0.0)
    get_recipe("specdecpp").validate(cfg)
    objective = specdecpp.build(cfg, tgt)
    torch.manual_seed(0)
    feats = objective.features(tgt, greedy_batch(reference))
    opt = torch.optim.AdamW(objective.module.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss, metrics = objective.loss({}, feats)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    config = {**objective.export_config(), "target": tgt.identity(), "training": {"steps": 40}}
    out = write_export(
        tmp_path_factory.mktemp("specdecpp") / "export", objective.module.state_dict(), config
    )
    return objective, feats, losses, out


def test_training_labels_and_loss(trained):
    objective, feats, losses, _ = trained
    assert objective.frozen["drafter"] is objective.drafter and not any(
        p.requires_grad for p in objective.drafter.parameters()
    )
    assert feats.states.shape[0] == feats.labels.shape[0] > 20
    assert (
        bool(((feats.labels >= 0) & (feats.labels <= 1)).all())
        and 0 < float(feats.labels.mean()) < 1
    )
    assert losses[-1] < 0.8 * losses[0]


def eagle3_export(tgt: Target, lean, folder: Path) -> Path:
    from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from draftsmith.drafters.vocab import vocab_maps

    torch.manual_seed(2)
    d2t, t2d = vocab_maps(torch.arange(0, lean.config.vocab_size, 2), lean.config.vocab_size)
    arch = Eagle3Config(
        **EagleConfig.dims_from_hf(tgt.config),
        draft_vocab_size=int(t2d.sum()),
        target_layers=(1, 2, 3),
    )
    drafter = Eagle3Drafter(arch, lean.embed_weight, d2t, t2d)
    config = {
        "method": "eagle3",
        "architecture": drafter.architecture(),
        "target": tgt.identity(),
        "inference": {"proposer": "chain", "depth": 4, "verifier": "greedy"},
    }
    return write_export(folder, drafter.state_dict(), config)


@pytest.mark.parametrize("base", ["eagle", "eagle3"])
def test_training_state_is_the_runtime_stop_state(target, reference, drafters, base, tmp_path):
    """Greedy labels (temperature 0): the state the head trains on for the candidate after position
    t is the state the runtime chain hands the stop policy for its first drafted token, from the
    same context (EAGLE-3: over its reduced draft vocabulary)."""
    tgt, lean = target
    prompt = PROMPTS[0]
    batch = greedy_batch(reference)  # row 0: PROMPTS[0] and its greedy continuation, unpadded
    drafter = drafters[0] if base == "eagle" else eagle3_export(tgt, lean, tmp_path / "e3")
    objective = specdecpp.build(recipe_cfg(drafter, temperature=0.0, mixing_ratio=0.0), tgt)
    feats = objective.features(tgt, {k: v[:1] for k, v in batch.items()})
    head = ScriptedHead([0.99])
    proposer = LearnedStopProposer(
        build_proposer(drafter, lean, policy="chain"),
        head,
        LearnedStop(head, threshold=0.5, max_depth=4),
    )
    SpeculativeDecoder(lean, proposer).generate(prompt, 2)
    t = len(prompt) - 1  # the runtime's root is the target's token after the prompt, x_{t+1}
    torch.testing.assert_close(head.states[0].float(), feats.states[t], atol=1e-4, rtol=1e-4)
    assert bool(
        ((feats.labels == 0) | (feats.labels == 1)).all()
    )  # greedy: accepted iff the target's argmax
    if base == "eagle3":  # sampled labels over the reduced vocabulary stay probabilities
        sampled = specdecpp.build(
            recipe_cfg(drafter, temperature=1.0, mixing_ratio=0.3, mixed_in_loss=True), tgt
        )
        feats = sampled.features(tgt, batch)
        assert (
            bool(((feats.labels >= 0) & (feats.labels <= 1)).all())
            and float(feats.weight.min()) == 1.0
        )


# ---- exports and the runtime ---------------------------------------------------------------------


def test_export_references_its_drafter_and_refuses_another(trained, drafters, target):
    _, _, _, export = trained
    head, config = AcceptanceHead.from_export(export)
    assert base_export_dir(config) == drafters[0].resolve()
    with pytest.raises(
        ExportError, match="is not the eagle export this specdecpp export was trained on"
    ):
        AcceptanceHead.from_export(export, base_dir=drafters[1])
    with pytest.raises(ExportError, match="is not the eagle export"):
        build_proposer(export, target[1], base_export=drafters[1])


@pytest.mark.parametrize(
    "spec", [None, "fixed:3", "confidence:0.6", "learned:0.3", "learned:0.6:2:5"]
)
def test_greedy_decoding_is_lossless_with_every_stop_policy(trained, target, reference, spec):
    _, _, _, export = trained
    lean = target[1]
    from draftsmith.export.format import read_config

    config = read_config(export)
    policy, info = choose_stop_policy(
        spec, config
    )  # no folder: the proposer binds its own head to learned:H
    assert info["source"] == ("export" if spec is None else "flag")
    dec = SpeculativeDecoder(lean, build_proposer(export, lean), stop_policy=policy)
    depths = []
    for prompt in PROMPTS:
        res = dec.generate(prompt, NEW)
        assert res.tokens == reference[tuple(prompt)], (spec, prompt)
        depths += res.depths
    if spec == "fixed:3":
        assert max(depths) == 3
    with_folder, _ = choose_stop_policy(spec, config, export)
    if spec and spec.startswith("learned"):
        assert isinstance(with_folder, LearnedStop) and isinstance(with_folder.head, AcceptanceHead)


# ---- bad input -----------------------------------------------------------------------------------


def test_bad_stop_policies_and_recipe_config_are_named(drafters, tmp_path):
    with pytest.raises(ValueError, match=r"outside \(0, 1\)"):
        parse_stop_policy("learned:1.5")
    with pytest.raises(ValueError, match=r"outside \(0, 1\)"):
        parse_stop_policy("confidence:0")
    with pytest.raises(ValueError, match="use fixed:K, confidence:THRESHOLD.*learned:H"):
        parse_stop_policy("sometimes:3")
    with pytest.raises(ValueError, match="needs an acceptance head"):
        choose_stop_policy("learned:0.3", {"method": "eagle"})
    validate = get_recipe("specdecpp").validate
    with pytest.raises(ConfigError, match="pass drafter=EXPORT_DIR"):
        validate(recipe_cfg(None))
    with pytest.raises(
        ConfigError, match=r"inference\.threshold=1\.2 is out of range: allowed > 0 and < 1"
    ):
        validate(recipe_cfg(drafters[0], {"threshold": 1.2}))
    with pytest.raises(
        ConfigError, match=r"need 1 <= inference\.min_depth <= inference\.max_depth, got 5, 3"
    ):
        validate(recipe_cfg(drafters[0], {"min_depth": 5, "max_depth": 3}))
    with pytest.raises(ConfigError, match="nowhere does not exist"):
        validate(recipe_cfg(tmp_path / "nowhere"))
