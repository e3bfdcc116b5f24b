"""EAGLE-1 / EAGLE-3 runtime: dynamic-tree construction on a known distribution, greedy losslessness
with random and trained drafters (loaded from exports), drafter feature feeding and export errors
(exact rejection sampling: test_eagle_sampling.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_llama
from recipe_configs import recipe_config

from draftsmith.distill.target.frozen import Target
from draftsmith.drafters.eagle import EagleConfig, EagleDrafter, KVCache
from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from draftsmith.drafters.vocab import vocab_maps
from draftsmith.export.format import TargetMismatchError, write_export
from draftsmith.recipes.eagle import objective as eagle_recipe
from draftsmith.recipes.eagle3 import objective as eagle3_recipe
from draftsmith.runtime.acceptance.stop_policies import ConfidenceStop, FixedDepth
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import StepContext
from draftsmith.runtime.drafting.eagle_adapters import Eagle1DraftModel, Eagle3DraftModel
from draftsmith.runtime.drafting.eagle_models import DraftModel
from draftsmith.runtime.drafting.eagle_proposer import EagleProposer
from draftsmith.runtime.drafting.registry import build_proposer, registered_methods
from draftsmith.runtime.target.hf import HFModelAdapter
from draftsmith.runtime.target.interface import TargetWrapper
from draftsmith.runtime.target.model import LeanDecoder, ModelConfig
from draftsmith.runtime.target.output import TargetOutput

pytestmark = pytest.mark.unit

PROMPTS = [[5, 9, 13, 40], [7, 60, 61], [30, 31, 32, 33, 34, 35, 100, 101, 8]]
NEW = 48
LAYERS = (1, 2, 3)  # EAGLE-3 taps of the 4-layer tiny target
ROOT = Path(__file__).resolve().parents[1]


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


# ---- dynamic tree on a fixed toy distribution ----------------------------------------------------

# Next-token law of a bigram "drafter" over a 5-token draft vocabulary (rows: previous token).
BIGRAM = torch.tensor(
    [
        [0.05, 0.50, 0.30, 0.10, 0.05],
        [0.05, 0.05, 0.00, 0.70, 0.20],
        [0.03, 0.90, 0.00, 0.05, 0.02],
        [0.40, 0.05, 0.05, 0.00, 0.50],
        [0.20, 0.20, 0.20, 0.20, 0.20],
    ],
    dtype=torch.float64,
)


class BigramStub(DraftModel):
    """A DraftModel whose logits only depend on the input token; it records every call and keeps a
    dummy cache."""

    feature_taps = ()

    def __init__(self, draft_ids: torch.Tensor | None = None, vocab_size: int = 5) -> None:
        self.draft_ids, self.vocab_size = draft_ids, vocab_size
        ids = torch.arange(5) if draft_ids is None else draft_ids
        self.to_draft = torch.full((vocab_size,), -1, dtype=torch.long).index_copy_(
            0, ids, torch.arange(5)
        )
        self.calls: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []

    def features(self, feats):
        return feats[None]

    def step(self, hidden, ids, cache, positions, tree_mask, last_only):
        self.calls.append((ids.clone(), positions, tree_mask))
        d = self.to_draft[ids]  # [1, S] draft ids
        assert bool((d >= 0).all()), "the stub got a token outside its vocabulary"
        logits = BIGRAM.clamp(min=1e-9).log().float()[d]  # [1, S, 5]
        entry = torch.zeros(1, 1, ids.shape[1], 1)
        cache = KVCache(entry, entry) if cache is None else cache.append(entry, entry)
        return F.one_hot(d, 5).float(), logits[:, -1:] if last_only else logits, cache


def propose_once(proposer: EagleProposer, prompt: list[int], root: int, policy=None):
    tokens = torch.tensor(prompt + [root])
    proposer.begin(StepContext(tokens=tokens, root_token=root, hidden=torch.zeros(len(prompt), 1)))
    return proposer.propose(
        StepContext(tokens=tokens, root_token=root, hidden=torch.zeros(1), stop_policy=policy)
    )


@pytest.mark.parametrize("mapped", [False, True])
def test_dynamic_tree_on_a_fixed_distribution_gives_the_known_tree(mapped):
    # Scores (products of probabilities) of the generated nodes, in generation order: depth 1: 1
    # .50, 2 .30 | expansion 1: 1>3 .35, 1>4 .10, 2>1 .27, 2>3 .015 -> frontier {1>3, 2>1} expansion
    # 2: 1>3>4 .175, 1>3>0 .14, 2>1>3 .189, 2>1>4 .054. Best 6: .50 .35 .30 .27 .189 .175.
    draft_ids = (
        torch.tensor([1, 4, 7, 10, 13]) if mapped else None
    )  # reduced vocab: target id 3d + 1
    stub = BigramStub(draft_ids, 16 if mapped else 5)
    tgt = (lambda d: [int(draft_ids[i]) for i in d]) if mapped else (lambda d: list(d))
    proposer = EagleProposer(stub, "tree", total_tokens=7, depth=2, top_k=2)
    tree = propose_once(proposer, tgt([0, 0]), tgt([0])[0])
    assert tree.tokens.tolist() == tgt([0, 1, 2, 3, 1, 4, 3])
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2, 3, 4]
    assert torch.allclose(
        tree.draft_confidence, torch.tensor([1, 0.5, 0.3, 0.7, 0.9, 0.5, 0.7]), atol=1e-5
    )
    assert tree.draft_mode == "point_mass" and tree.draft_q is None
    # One drafter forward per level: the root step (prompt pairs + root), then each frontier in one
    # batch.
    (ids0, pos0, mask0), (ids1, pos1, mask1), (ids2, pos2, mask2) = stub.calls
    assert ids0.tolist() == [tgt([0, 0])] and pos0 is None and mask0 is None
    assert ids1.tolist() == [tgt([1, 2])] and pos1.tolist() == [[2, 2]]
    assert mask1.int().tolist() == [[1, 1, 1, 0], [1, 1, 0, 1]]
    assert ids2.tolist() == [tgt([3, 1])] and pos2.tolist() == [[3, 3]]
    # 1>3 sees its parent 1 (first tree entry), 2>1 its parent 2 (second), each itself.
    assert mask2.int().tolist() == [[1, 1, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1]]
    assert (
        proposer.num_committed == 2 and proposer.cache.length == 2
    )  # speculative entries are not kept


def test_stop_policies_and_chain_on_the_fixed_distribution():
    stub = BigramStub()
    tree_proposer = EagleProposer(stub, "tree", total_tokens=7, depth=2, top_k=2)
    # Node 2 (p .3) and node 1>4 (p .2) fall below the confidence threshold: they get no children.
    tree = propose_once(tree_proposer, [0, 0], 0, ConfidenceStop(0.4, max_depth=8))
    assert tree.tokens.tolist() == [0, 1, 2, 3, 4, 4, 0] and tree.parents.tolist() == [
        -1,
        0,
        0,
        1,
        1,
        3,
        3,
    ]
    tree = propose_once(tree_proposer, [0, 0], 0, FixedDepth(1))
    assert tree.tokens.tolist() == [0, 1, 2] and tree.parents.tolist() == [-1, 0, 0]
    chain = EagleProposer(stub, "chain", depth=2)
    assert chain.max_tree_nodes == 4
    tree = propose_once(chain, [0, 0], 0)
    assert tree.tokens.tolist() == [0, 1, 3, 4] and tree.parents.tolist() == [
        -1,
        0,
        1,
        2,
    ]  # greedy: depth + 1 drafts
    assert propose_once(chain, [0, 0], 0, FixedDepth(2)).tokens.tolist() == [0, 1, 3]
    assert propose_once(chain, [0, 0], 0, ConfidenceStop(0.6)).tokens.tolist() == [
        0,
        1,
    ]  # p(1) = .5 < .6
    with pytest.raises(ValueError, match="temperature > 0 is for policy='chain'"):
        EagleProposer(stub, "tree", temperature=1.0)
    with pytest.raises(ValueError, match="top_k <= 5"):
        EagleProposer(stub, "tree", top_k=6)
    with pytest.raises(RuntimeError, match="call begin"):
        EagleProposer(stub).propose(
            StepContext(tokens=torch.tensor([0, 0]), root_token=0, hidden=torch.zeros(1))
        )


def test_sampled_chain_records_its_law_on_the_target_vocabulary():
    stub = BigramStub(torch.tensor([1, 4, 7, 10, 13]), 16)
    proposer = EagleProposer(stub, "chain", depth=1, temperature=0.5)
    proposer.begin(StepContext(tokens=torch.tensor([1, 1]), root_token=1, hidden=torch.zeros(1, 1)))
    tree = proposer.propose(
        StepContext(
            tokens=torch.tensor([1, 1]),
            root_token=1,
            hidden=torch.zeros(1),
            generator=torch.Generator().manual_seed(0),
        )
    )
    assert tree.draft_mode == "with_replacement" and tree.draft_q.shape == (3, 16)
    expected = torch.zeros(16, dtype=torch.float64)
    expected[[1, 4, 7, 10, 13]] = torch.softmax(BIGRAM[0].log() / 0.5, -1)
    torch.testing.assert_close(tree.draft_q[0], expected, atol=1e-6, rtol=0)
    assert tree.draft_q[2].sum() == 0 and float(tree.draft_q[0, tree.tokens[1]]) > 0


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
