"""EAGLE-1 / EAGLE-3 runtime: greedy losslessness with random and trained drafters (loaded from
exports), drafter feature feeding and export errors (dynamic-tree construction on a known
distribution: test_eagle_draft_trees.py; exact rejection sampling: test_eagle_sampling.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_llama
from recipe_configs import recipe_config

from draftsmith.distill.target.frozen import Target
from draftsmith.drafters.eagle import EagleConfig, EagleDrafter
from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from draftsmith.drafters.vocab import vocab_maps
from draftsmith.export.format import TargetMismatchError, write_export
from draftsmith.recipes.eagle import objective as eagle_recipe
from draftsmith.recipes.eagle3 import objective as eagle3_recipe
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.eagle import Eagle1DraftModel, Eagle3DraftModel, EagleProposer
from draftsmith.runtime.drafting.registry import build_proposer, registered_methods
from draftsmith.runtime.target.hf import HFModelAdapter
from draftsmith.runtime.target.interface import TargetWrapper
from draftsmith.runtime.target.model import LeanDecoder, ModelConfig
from draftsmith.runtime.target.output import TargetOutput

pytestmark = pytest.mark.unit

PROMPTS = [[5, 9, 13, 40], [7, 60, 61], [30, 31, 32, 33, 34, 35, 100, 101, 8]]
NEW = 48
LAYERS = (1, 2, 3)  # EAGLE-3 taps of the 4-layer tiny target


def lean_from_hf(hf: torch.nn.Module) -> LeanDecoder:
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return LeanDecoder(
        ModelConfig.from_hf_dict(hf.config.to_dict()), weights, kernel_backend="torch"
    ).eval()


def plain_greedy(model: LeanDecoder, prompt: list[int], n: int) -> list[int]:
    cache = model.allocate_cache(len(prompt) + n)
    logits = model.forward(torch.tensor(prompt), cache).logits
    cache.commit(len(prompt))
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        logits = model.forward(torch.tensor(out[-1:]), cache).logits
        cache.commit(1)
        out.append(int(logits[-1].argmax()))
    return out


# ---- greedy losslessness on a tiny Llama ---------------------------------------------------------


@pytest.fixture(scope="module")
def target(tiny_tokenizer):
    """(distill Target, LeanDecoder) over one tiny 4-layer Llama whose greedy argmax has clear
    margins."""
    hf = build_tiny_llama(len(tiny_tokenizer), initializer_range=0.2)
    return Target(hf, tiny_tokenizer, "tiny"), lean_from_hf(hf)


@pytest.fixture(scope="module")
def reference(target):
    return {tuple(p): plain_greedy(target[1], p, NEW) for p in PROMPTS}


def random_drafters(tgt: Target, lean: LeanDecoder):
    torch.manual_seed(0)
    dims = EagleConfig.dims_from_hf(tgt.config)
    e1 = EagleDrafter(EagleConfig(**dims), lean.embed_weight, lean.lm_head_weight)
    d2t, t2d = vocab_maps(torch.arange(0, lean.config.vocab_size, 2), lean.config.vocab_size)
    e3 = Eagle3Drafter(
        Eagle3Config(**dims, draft_vocab_size=int(t2d.sum()), target_layers=LAYERS),
        lean.embed_weight,
        d2t,
        t2d,
    )
    return {"eagle": Eagle1DraftModel(e1), "eagle3": Eagle3DraftModel(e3)}


@pytest.mark.parametrize("policy", ["chain", "tree"])
def test_greedy_with_random_drafters_is_lossless(target, reference, policy):
    for name, model in random_drafters(*target).items():
        dec = SpeculativeDecoder(
            target[1], EagleProposer(model, policy, total_tokens=10, depth=3, top_k=3)
        )
        for prompt in PROMPTS:
            res = dec.generate(prompt, NEW)
            assert res.tokens == reference[tuple(prompt)], (name, prompt)
            assert max(res.tree_sizes) == (10 if policy == "tree" else 5)


def greedy_batch(reference) -> dict[str, torch.Tensor]:
    """The prompts and the target's own greedy continuations, right-padded, every token a label."""
    seqs = [p + reference[tuple(p)] for p in PROMPTS]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [1] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": attn.clone()}


def train(objective, target: Target, batch: dict[str, torch.Tensor], steps: int = 60) -> None:
    feats = target.features(
        batch["input_ids"], batch["attention_mask"], objective.taps
    )  # frozen: computed once
    opt = torch.optim.AdamW(objective.module.parameters(), lr=3e-3)
    objective.module.train()
    for _ in range(steps):
        loss, _ = objective.loss(batch, feats)
        opt.zero_grad()
        loss.backward()
        opt.step()
    objective.module.eval()


@pytest.fixture(scope="module")
def exports(target, reference, tmp_path_factory):
    """EAGLE-1 and EAGLE-3 drafters trained briefly on the target's greedy outputs, written as
    export folders."""
    tgt, _ = target
    batch = greedy_batch(reference)
    torch.manual_seed(0)
    cfg1 = recipe_config("eagle", {"drafter": {"noise_std": 0.0}})
    cfg3 = recipe_config(
        "eagle3", {"drafter": {"target_layers": list(LAYERS), "draft_vocab_size": 64}}
    )
    objectives = {
        "eagle": eagle_recipe.build(cfg1, tgt),
        "eagle3": eagle3_recipe.build_objective(
            cfg3, tgt, [(batch["input_ids"], batch["loss_mask"])]
        ),
    }
    out = {}
    for name, objective in objectives.items():
        train(objective, tgt, batch)
        config = {**objective.export_config(), "target": tgt.identity(), "training": {"steps": 60}}
        out[name] = write_export(
            tmp_path_factory.mktemp(name) / "export", objective.module.state_dict(), config
        )
    return out


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("policy", ["chain", "tree"])
def test_trained_drafters_from_exports_are_lossless_and_accept(
    target, reference, exports, method, policy
):
    proposer = build_proposer(exports[method], target[1], policy=policy)
    assert proposer.policy == policy and (
        proposer.total_tokens,
        proposer.depth,
        proposer.top_k,
    ) == (16, 4, 4)
    dec = SpeculativeDecoder(target[1], proposer)
    taus = []
    for prompt in PROMPTS:
        res = dec.generate(prompt, NEW)
        assert res.tokens == reference[tuple(prompt)], prompt
        taus.append(res.tau)
    # Memorised continuations: acceptance is high only if the runtime feeds the features the drafter
    # trained on.
    assert min(taus) > 2.5, taus


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_incremental_drafter_cache_equals_a_full_recompute(target, reference, exports, method):
    """After a generation, the drafter's committed cache equals one drafter forward over all
    (feature, next token) pairs of the final sequence, with the features from a single target
    forward."""
    lean = target[1]
    proposer = build_proposer(
        exports[method], lean, policy="tree", total_tokens=8, depth=2, top_k=3
    )
    prompt = PROMPTS[2]
    res = SpeculativeDecoder(lean, proposer).generate(prompt, 30)
    seq = torch.tensor(prompt + res.tokens)
    n = proposer.num_committed
    assert len(prompt) < n < seq.numel() and res.steps > 1
    cache = lean.allocate_cache(seq.numel())
    res = lean.forward(seq, cache, taps=proposer.feature_taps)
    feats = res.tap_features(proposer.feature_taps) if proposer.feature_taps else res.hidden
    with torch.no_grad():
        _, _, full = proposer.model.step(
            proposer.model.features(feats[:n]), seq[1 : n + 1][None], None, None, None, True
        )
    inc = proposer.cache.crop(n)
    torch.testing.assert_close(inc.key, full.key, atol=1e-4, rtol=0)
    torch.testing.assert_close(inc.value, full.value, atol=1e-4, rtol=0)


def test_build_proposer_options_and_target_mismatch(target, exports, tiny_tokenizer):
    tgt, lean = target
    assert {"eagle", "eagle3", "medusa"} <= set(registered_methods())
    proposer = build_proposer(
        exports["eagle3"], lean, total_tokens=9, depth=2, top_k=2, identity=tgt.identity()
    )
    assert (proposer.max_tree_nodes, proposer.depth, proposer.top_k) == (9, 2, 2)
    assert proposer.feature_taps == LAYERS
    chain = build_proposer(exports["eagle"], lean, policy="chain", depth=3, temperature=0.7)
    assert chain.max_tree_nodes == 5 and chain.feature_taps == ()
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['tree'\]"):
        build_proposer(exports["eagle"], lean, tree=[[0]])
    other = Target(build_tiny_llama(len(tiny_tokenizer), seed=1), tiny_tokenizer, "tiny")
    with pytest.raises(TargetMismatchError, match="fingerprint"):
        build_proposer(exports["eagle"], lean, identity=other.identity())
    wider = lean_from_hf(build_tiny_llama(len(tiny_tokenizer), hidden_size=32))
    for method in ("eagle", "eagle3"):
        with pytest.raises(TargetMismatchError, match="hidden_size: export has 64, target has 32"):
            build_proposer(exports[method], wider)
    shallow = lean_from_hf(build_tiny_llama(len(tiny_tokenizer), num_hidden_layers=3))
    with pytest.raises(TargetMismatchError, match="num_hidden_layers: export has 4, target has 3"):
        build_proposer(exports["eagle3"], shallow)

    class DropsTaps(TargetWrapper):  # a backend whose forward ignores the taps it is asked for
        def forward(self, *args, taps=(), **kwargs):
            out = lean.forward(*args, **kwargs)
            return TargetOutput(out.logits, out.hidden)

    with pytest.raises(ValueError, match=r"returned no taps for layers \[1, 2, 3\]"):
        SpeculativeDecoder(DropsTaps(lean), proposer).generate(PROMPTS[0], 4)


def test_eagle3_serves_through_the_hf_fallback_with_the_lean_decoders_tokens(target, exports):
    """Taps are part of the one forward result, so the HF fallback (transformers' hidden_states)
    serves EAGLE-3 too."""
    tgt, lean = target
    hf = HFModelAdapter(tgt.model)
    for prompt in PROMPTS[:2]:
        want = (
            SpeculativeDecoder(lean, build_proposer(exports["eagle3"], lean, depth=2))
            .generate(prompt, 16)
            .tokens
        )
        got = (
            SpeculativeDecoder(hf, build_proposer(exports["eagle3"], hf, depth=2))
            .generate(prompt, 16)
            .tokens
        )
        assert got == want
    with pytest.raises(ValueError, match="the HF fallback can tap decoder-layer inputs 0..3"):
        hf.forward(torch.tensor([1, 2]), hf.allocate_cache(4), taps=(4,))
