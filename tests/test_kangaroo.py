"""Kangaroo: the shallow sub-network is the target's (shared storage), training lowers the soft CE
and logs the expected acceptance, verification over the reused shallow states equals a full forward,
greedy decoding is lossless with every stop policy, sampled drafting keeps the target's law, and bad
input is named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_llama
from recipe_configs import recipe_config
from test_eagle_runtime import lean_from_hf, plain_greedy
from test_speculative import tiny_llama
from test_speculative_sampling import ALPHA, SMALL_V, chi2_pvalue

from draftsmith.common.errors import ConfigError
from draftsmith.controllers.acceptance import AcceptanceHead, AcceptanceHeadConfig
from draftsmith.distill.target.frozen import Target
from draftsmith.drafters.kangaroo import KangarooConfig, KangarooDrafter, default_exit_layer
from draftsmith.export.format import write_export
from draftsmith.recipes import get_recipe
from draftsmith.recipes.kangaroo import Kangaroo
from draftsmith.recipes.kangaroo import objective as recipe
from draftsmith.runtime.acceptance.choice import parse_stop_policy
from draftsmith.runtime.acceptance.rejection_sampling import RejectionSamplingVerifier
from draftsmith.runtime.acceptance.stop_policies import LearnedStop
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import StepContext
from draftsmith.runtime.drafting.kangaroo import KangarooProposer
from draftsmith.runtime.drafting.registry import build_proposer

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 9, 13, 40], [7, 60, 61]]
NEW = 24


@pytest.fixture(scope="module")
def target(tiny_tokenizer):
    hf = build_tiny_llama(len(tiny_tokenizer), initializer_range=0.2)
    return Target(hf, tiny_tokenizer, "tiny"), lean_from_hf(hf)


@pytest.fixture(scope="module")
def reference(target):
    return {tuple(p): plain_greedy(target[1], p, NEW) for p in PROMPTS}


def cfg(inference: dict | None = None, **drafter) -> Kangaroo:
    return recipe_config(
        "kangaroo",
        {"drafter": drafter, "loss": {"fused_linear_ce": False}, "inference": inference or {}},
    )


def greedy_batch(reference):
    seqs = [p + reference[tuple(p)] for p in PROMPTS]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [1] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": attn.clone()}


@pytest.fixture(scope="module")
def trained(target, reference, tmp_path_factory):
    """The recipe's objective trained briefly on the target's greedy outputs, its metrics, and its
    export."""
    tgt, _ = target
    conf = cfg(exit_layer=1)
    get_recipe("kangaroo").validate(conf)
    objective = recipe.build(conf, tgt)
    batch = greedy_batch(reference)
    feats = tgt.features(batch["input_ids"], batch["attention_mask"], objective.taps)
    opt = torch.optim.AdamW(objective.module.parameters(), lr=3e-3)
    history = []
    objective.module.train()
    for _ in range(40):
        loss, metrics = objective.loss(batch, feats)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append((float(loss.detach()), float(metrics["accept"])))
    objective.module.eval()
    config = {**objective.export_config(), "target": tgt.identity(), "training": {"steps": 40}}
    out = write_export(
        tmp_path_factory.mktemp("kangaroo") / "export", objective.module.state_dict(), config
    )
    return objective, history, out


def test_shallow_subnetwork_shares_the_target_storage(target, trained):
    tgt, lean = target
    objective, _, export = trained
    drafter = objective.module
    hf_layer = tgt.model.get_decoder().layers[0]
    assert drafter.shallow_layers[0] is hf_layer
    ours = {n: p.data_ptr() for n, p in drafter.shallow_layers[0].named_parameters()}
    assert ours == {n: p.data_ptr() for n, p in hf_layer.named_parameters()}
    assert drafter.lm_head_weight.data_ptr() == tgt.lm_head_weight.data_ptr()
    assert all(
        k.startswith("adapter.") for k in drafter.state_dict()
    )  # only the adapter trains and exports
    proposer = build_proposer(export, lean)
    assert [la.wqkv.data_ptr() for la in proposer.shallow_layers()] == [
        lean.layers[0].wqkv.data_ptr()
    ]
    assert proposer.drafter.lm_head_weight.data_ptr() == lean.lm_head_weight.data_ptr()


def test_training_lowers_the_soft_ce_and_logs_expected_acceptance(target, reference, trained):
    objective, history, _ = trained
    (first_loss, first_acc), (last_loss, last_acc) = history[0], history[-1]
    # soft CE >= H(p): compare drops
    assert last_loss < first_loss - 0.5 and last_acc > first_acc + 0.05
    # The logged metric is sum_v min(p, q) at each scored row, averaged.
    h, w = torch.randn(5, 64), objective.module.lm_head_weight
    teacher = torch.randn(5, w.shape[0])
    want = torch.minimum(F.softmax(teacher, -1), F.softmax(h @ w.T, -1)).sum(-1).mean()
    torch.testing.assert_close(recipe.expected_acceptance(h, w, teacher, chunk=2), want)


def wrapped(export, lean, **options):
    proposer = build_proposer(export, lean, **options)
    return proposer, proposer.wrap_target(lean)


def test_verification_over_reused_shallow_states_equals_a_full_forward(target, trained):
    _, lean = target
    proposer, model = wrapped(trained[2], lean, threshold=0.01, max_depth=4)
    prompt = torch.tensor(PROMPTS[0])
    cache = model.allocate_cache(16)
    pre = model.forward(prompt, cache, logits_for="last", taps=proposer.feature_taps)
    cache.commit(prompt.numel())
    root = int(pre.logits[-1].argmax())
    tokens = torch.cat([prompt, torch.tensor([root])])
    proposer.begin(
        StepContext(
            tokens=tokens,
            root_token=root,
            hidden=pre.hidden,
            taps=pre.tap_features(proposer.feature_taps),
        )
    )
    tree = proposer.propose(StepContext(tokens=tokens, root_token=root, hidden=pre.hidden[-1]))
    assert tree.num_nodes == 5
    positions = prompt.numel() + tree.depths
    got = model.forward(tree.tokens, cache, tree.tree_mask, positions, taps=proposer.feature_taps)
    assert model.reused_tokens == 5 and model.saved_share() == pytest.approx(1 / 4)
    full_cache = lean.allocate_cache(16)
    lean.forward(prompt, full_cache)
    full_cache.commit(prompt.numel())
    want = lean.forward(
        tree.tokens, full_cache, tree.tree_mask, positions, taps=proposer.feature_taps
    )
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.taps[1], want.taps[1], atol=1e-5, rtol=1e-5)
    n = prompt.numel() + 5
    for (k, v), (k_ref, v_ref) in zip(cache.layers, full_cache.layers):
        torch.testing.assert_close(k[:, :n], k_ref[:, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v[:, :n], v_ref[:, :n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", [None, "fixed:3", "confidence:0.3", "learned"])
def test_greedy_decoding_is_lossless_with_every_stop_policy(target, reference, trained, spec):
    _, lean = target
    proposer, model = wrapped(trained[2], lean)
    if spec == "learned":  # SpecDec++'s rule over the adapter's states
        torch.manual_seed(0)
        policy = LearnedStop(
            AcceptanceHead(AcceptanceHeadConfig(64, 2)).eval(), threshold=0.5, max_depth=5
        )
    else:
        policy = parse_stop_policy(spec)
    dec = SpeculativeDecoder(model, proposer, stop_policy=policy)
    for prompt in PROMPTS:
        res = dec.generate(prompt, NEW)
        assert res.tokens == reference[tuple(prompt)], (spec, prompt)
        if spec == "fixed:3":
            assert max(res.depths) == 3
    assert model.saved_share() == pytest.approx(1 / 4)  # every verified token skipped layer 0 of 4


# thousands of whole sampled decodes for a chi-square: over 5 s, so not in the unit tier
@pytest.mark.e2e
def test_sampled_drafting_keeps_the_target_law(tmp_path):
    hf, lean = tiny_llama(3, vocab=SMALL_V, hidden=32, layers=2, head_scale=10.0)
    prompt = [1, 2, 3]
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)
        p2 = torch.softmax(
            hf(torch.tensor([prompt + [a] for a in range(SMALL_V)])).logits[:, -1].double(), -1
        )
    joint = p1[:, None] * p2
    torch.manual_seed(1)
    arch = KangarooConfig(
        hidden_size=32,
        vocab_size=SMALL_V,
        num_attention_heads=4,
        num_key_value_heads=2,
        exit_layer=1,
        num_target_layers=2,
    )
    drafter = KangarooDrafter(arch, lean.lm_head_weight, tuple(lean.layers[:1]))
    with torch.no_grad():
        drafter.adapter.self_attn.o_proj.weight.normal_(
            0, 0.3
        )  # not the early-exit start: a real adapter
    proposer = KangarooProposer(lean, drafter, threshold=0.3, max_depth=2, temperature=1.0)
    dec = SpeculativeDecoder(
        proposer.wrap_target(lean), proposer, RejectionSamplingVerifier(temperature=1.0)
    )
    counts, gen, depths = torch.zeros(SMALL_V, SMALL_V), torch.Generator().manual_seed(0), set()
    for _ in range(1000):
        res = dec.generate(prompt, 2, generator=gen)
        counts[res.tokens[0], res.tokens[1]] += 1
        depths.update(res.depths)
    assert depths == {1, 2}  # the confidence stop varies the draft length
    assert chi2_pvalue(counts, joint) > ALPHA


def test_bad_input_is_named(target, trained):
    tgt, lean = target
    assert [default_exit_layer(n) for n in (32, 40, 30, 4)] == [2, 3, 2, 1]
    with pytest.raises(
        ConfigError, match=r"exit_layer 4 is outside the target's depth: valid choices are 1\.\.3"
    ):
        recipe.build(cfg(exit_layer=4), tgt)
    with pytest.raises(
        ConfigError, match="exit_layer=deep is out of range: allowed auto .* or an integer >= 1"
    ):
        get_recipe("kangaroo").validate(cfg(exit_layer="deep"))
    with pytest.raises(
        ConfigError, match=r"inference\.threshold=1\.0 is out of range: allowed > 0 and < 1"
    ):
        get_recipe("kangaroo").validate(cfg({"threshold": 1.0}))
    with pytest.raises(ValueError, match=r"threshold 1.5 is outside \(0, 1\)"):
        build_proposer(trained[2], lean, threshold=1.5)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['depth'\].*valid"):
        build_proposer(trained[2], lean, depth=3)


def test_an_unwrapped_loop_drafts_on_a_private_shallow_cache_and_stays_lossless(
    target, reference, trained
):
    _, lean = target
    proposer = build_proposer(trained[2], lean)
    dec = SpeculativeDecoder(
        lean, proposer
    )  # the loop as `draftsmith bench` builds it today: no shallow reuse
    for prompt in PROMPTS:
        res = dec.generate(prompt, NEW)
        assert res.tokens == reference[tuple(prompt)]
        assert proposer.private and proposer.cache.length == len(prompt) + res.steps + sum(
            res.accepted_per_step
        )
    assert res.tau > 1.0


def test_specdecpp_head_on_a_kangaroo_drafter(target, reference, trained, tmp_path):
    """The head trains on the adapter state of each candidate (here one candidate, right after the
    prompt: the runtime's first stop state), and its export drives the Kangaroo chain losslessly."""
    from test_specdecpp_stop_rule import ScriptedHead

    from draftsmith.recipes.specdecpp import objective as specdecpp
    from draftsmith.runtime.drafting.specdecpp import LearnedStopProposer

    tgt, lean = target
    prompt = PROMPTS[0]
    conf = recipe_config(
        "specdecpp", {"drafter": str(trained[2]), "head": {"temperature": 0.0, "mixing_ratio": 0.0}}
    )
    get_recipe("specdecpp").validate(conf)
    objective = specdecpp.build(conf, tgt)
    seq = torch.tensor([prompt + reference[tuple(prompt)]])
    loss_mask = torch.zeros_like(seq)
    # one candidate: the first drafted token (after the target's root token)
    loss_mask[0, len(prompt) + 1] = 1
    feats = objective.features(
        tgt, {"input_ids": seq, "attention_mask": torch.ones_like(seq), "loss_mask": loss_mask}
    )
    assert feats.states.shape == (1, 64)
    head = ScriptedHead([0.99])
    proposer = LearnedStopProposer(
        build_proposer(trained[2], lean), head, LearnedStop(head, 0.5, 4)
    )
    SpeculativeDecoder(proposer.wrap_target(lean), proposer).generate(prompt, 2)
    torch.testing.assert_close(
        head.states[0].float().reshape(-1), feats.states[0], atol=1e-4, rtol=1e-4
    )
    # The export: stacked on the Kangaroo export, greedy-lossless with its learned default policy
    # and shallow reuse.
    config = {**objective.export_config(), "target": tgt.identity(), "training": {}}
    export = write_export(tmp_path / "head", objective.module.state_dict(), config)
    proposer = build_proposer(export, lean)
    model = proposer.wrap_target(lean)
    dec = SpeculativeDecoder(model, proposer)
    for p in PROMPTS:
        assert dec.generate(p, NEW).tokens == reference[tuple(p)]
    assert model.saved_share() == pytest.approx(1 / 4)
    # Calibration of the head on held-out Kangaroo drafts (scored at every depth below the cap).
    from draftsmith.evals.calibrate import calibrate_decoder

    report = calibrate_decoder(
        lambda p: SpeculativeDecoder(lean, p),
        build_proposer(trained[2], lean, max_depth=4),
        objective.module.eval(),
        PROMPTS,
        16,
        4,
    )
    assert report["count"] > 0 and set(report["by_depth"]) <= {1, 2, 3} and 0 <= report["ece"] <= 1


def test_bench_reports_the_verify_compute_saved(tiny_target_dir, tiny_tokenizer, tmp_path):
    """`draftsmith bench` on a Kangaroo export serves through the shallow-reuse wrapper, stays
    lossless, and reports the share of verify compute the reuse saved (reused share x exit_layer /
    layers)."""
    from transformers import AutoModelForCausalLM

    from draftsmith.bench.report import write_outputs
    from draftsmith.bench.run import run_bench
    from draftsmith.runtime.serving import load_runtime

    tgt = Target(
        AutoModelForCausalLM.from_pretrained(tiny_target_dir), tiny_tokenizer, str(tiny_target_dir)
    )
    objective = recipe.build(cfg(exit_layer=1), tgt)
    config = {**objective.export_config(), "target": tgt.identity(), "training": {}}
    export = write_export(tmp_path / "export", objective.module.state_dict(), config)
    runtime = load_runtime(str(export), None, "fp32")
    result = run_bench(runtime, [[5, 9, 13, 40], [7, 60, 61]], max_new_tokens=16)
    reuse = result["verify_reuse"]
    assert result["lossless"] is True and 0 < reuse["reused_tokens"] <= reuse["verified_tokens"]
    assert reuse["verify_compute_saved"] == pytest.approx(
        reuse["reused_tokens"] / reuse["verified_tokens"] / 4
    )
    assert (
        "verify compute saved by the shallow cache"
        in (write_outputs(result, tmp_path / "b") / "bench.md").read_text()
    )
