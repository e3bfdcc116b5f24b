"""Medusa heads over a reduced draft vocabulary (``heads.draft_vocab_size``): rows of the target
head, loss equal to the restricted plain CE (out-of-vocabulary labels skipped), training, lossless
serving with target ids, the vLLM layout's token map, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_llama, train_on_fixed_batch
from recipe_configs import recipe_config
from safetensors.torch import load_file
from test_speculative import NEW, PROMPTS, VOCAB, plain_greedy, tiny_llama

from draftsmith.common.errors import ConfigError
from draftsmith.distill.engine.exporting import export_from_module
from draftsmith.distill.losses.core import LMHeadLoss
from draftsmith.distill.target.frozen import Target
from draftsmith.export.format import write_export
from draftsmith.export.medusa_layout import to_medusa_layout
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
from draftsmith.recipes import get_recipe
from draftsmith.recipes.medusa import objective as medusa_recipe
from draftsmith.recipes.medusa.objective import MedusaObjective, default_tree, medusa_head_loss
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.registry import build_proposer

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def target(tiny_tokenizer) -> Target:
    return Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")


def reduced_heads(
    target: Target, ids: torch.Tensor, num_heads: int = 2, share: bool = False
) -> MedusaHeads:
    torch.manual_seed(0)
    arch = MedusaConfig(
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        num_heads=num_heads,
        share_lm_head=share,
        draft_vocab_size=int(ids.numel()),
    )
    return MedusaHeads(arch, target.lm_head_weight.float(), draft_ids=ids)


def test_heads_start_from_the_target_rows_and_map_ids(target):
    ids = torch.tensor([3, 7, 8, 20, 41])
    heads = reduced_heads(target, ids)
    assert torch.equal(heads.heads[1].lm_head.weight, target.lm_head_weight.float()[ids])
    assert heads(torch.randn(4, target.hidden_size)).shape == (2, 4, 5)  # [K, T, V']
    assert heads.to_target_ids(torch.tensor([0, 4, 2])).tolist() == [3, 41, 8]
    assert heads.to_head_ids(torch.tensor([41, 3, 9])).tolist() == [
        4,
        0,
        -100,
    ]  # 9 is not draftable
    shared = reduced_heads(target, ids, share=True)
    x = torch.randn(3, target.hidden_size)
    want = F.linear(
        shared.heads[0].blocks(x), target.lm_head_weight.float()[ids]
    )  # the target head's draft rows
    assert torch.allclose(shared.head_logits(x, 0), want)


@pytest.mark.parametrize("fused", [True, False])
def test_loss_is_the_restricted_cross_entropy(target, fused):
    ids = torch.tensor([1, 4, 6, 9, 12, 30])
    heads = reduced_heads(target, ids)
    rows = torch.randn(5, target.hidden_size, requires_grad=True)
    labels = torch.tensor(
        [4, 5, 30, 1, 2]
    )  # 5 and 2 lie outside the draft vocabulary: they score nothing
    out = medusa_head_loss(LMHeadLoss(fused=fused), heads, rows, 1, labels=labels, topk=3)
    out.loss.backward()
    got = rows.grad.clone()
    rows.grad = None
    logits = heads.head_logits(rows, 1)  # [5, V']
    kept = torch.tensor([0, 2, 3])
    want = F.cross_entropy(logits[kept], torch.tensor([1, 5, 0]))
    want.backward()
    assert torch.allclose(out.loss, want, atol=1e-5) and torch.allclose(got, rows.grad, atol=1e-5)
    assert out.topk.shape == (5, 3) and set(out.topk.flatten().tolist()) <= set(
        ids.tolist()
    )  # target ids
    teacher = torch.randn(5, target.vocab_size)
    soft = medusa_head_loss(LMHeadLoss(fused=fused), heads, rows.detach(), 0, teacher=teacher)
    p = teacher[:, ids].softmax(-1)
    assert torch.allclose(
        soft.loss,
        -(p * heads.head_logits(rows.detach(), 0).log_softmax(-1)).sum(-1).mean(),
        atol=1e-5,
    )


def test_training_with_a_draft_vocabulary_lowers_the_loss(target):
    ids = torch.arange(5, 45)  # the batch's tokens all lie in it
    heads = reduced_heads(target, ids, num_heads=3)
    objective = MedusaObjective(
        heads, 0.8, "dataset", 5, default_tree(3, 8, 4), {"top_k": 4, "verifier": "greedy"}
    )
    batch_ids = torch.randint(5, 45, (4, 24), generator=torch.Generator().manual_seed(1))
    batch = {
        "input_ids": batch_ids,
        "attention_mask": torch.ones_like(batch_ids),
        "loss_mask": torch.ones_like(batch_ids),
    }
    feats = target.features(batch_ids, batch["attention_mask"], objective.taps)
    losses = train_on_fixed_batch(objective, batch, feats)
    assert losses[-1] < 0.7 * losses[0], losses


def test_recipe_counts_the_draft_vocabulary_and_exports_it(target, tmp_path, monkeypatch):
    counts = [(torch.tensor([[5, 5, 5, 9, 9, 11, 2]]), torch.tensor([[1, 1, 1, 1, 1, 1, 0]]))]
    monkeypatch.setattr(
        medusa_recipe,
        "count_draft_vocab",
        lambda cfg, tgt, size, samples=None, **kw: _d2t(counts, tgt.vocab_size, size),
    )
    cfg = recipe_config(
        "medusa", {"heads": {"draft_vocab_size": 3}, "distill": {"labels": "dataset"}}
    )
    objective = medusa_recipe.build(cfg, target)
    assert objective.module.draft_ids.tolist() == [
        5,
        9,
        11,
    ]  # the three most frequent assistant tokens
    assert objective.module.config.draft_vocab_size == 3

    class Live:
        drafter, run_info = objective.module, {"target": target.identity()}

    Live.objective = objective
    out = export_from_module(Live, tmp_path / "export", training={})
    reloaded, _ = MedusaHeads.from_export(out)
    assert torch.equal(reloaded.draft_ids, torch.tensor([5, 9, 11]))
    layout = to_medusa_layout(out, tmp_path / "vllm")
    cfg_json = json.loads((layout / "config.json").read_text())
    weights = load_file(layout / "model.safetensors")
    assert cfg_json["truncated_vocab_size"] == 3 and weights["token_map"].tolist() == [5, 9, 11]
    assert weights["lm_heads.0.weight"].shape == (3, target.hidden_size)
    assert not (
        layout / "medusa_lm_head.safetensors"
    ).exists()  # TGI's layout has no token map (medusa-tgi refuses)


def _d2t(batches, vocab, size):
    from draftsmith.drafters.vocab import draft_vocab_from_batches

    d2t, t2d, _ = draft_vocab_from_batches(batches, vocab, size)
    return d2t, t2d


def test_served_reduced_heads_are_lossless_and_propose_target_ids(tmp_path):
    hf, lean = tiny_llama(0, head_scale=8.0)
    ids = torch.arange(0, VOCAB, 3)  # every third token is draftable
    torch.manual_seed(2)
    arch = MedusaConfig(
        hidden_size=64, vocab_size=VOCAB, num_heads=2, draft_vocab_size=int(ids.numel())
    )
    heads = MedusaHeads(arch, lean.lm_head_weight.float(), draft_ids=ids)
    config = {
        "method": "medusa",
        "architecture": heads.architecture(),
        "target": {"name_or_path": "tiny"},
        "inference": {"tree": [[0], [1], [0, 0]], "top_k": 2, "verifier": "greedy"},
    }
    write_export(tmp_path / "medusa", heads.trainable_state_dict(), config)
    proposer = build_proposer(tmp_path / "medusa", lean)
    decoder = SpeculativeDecoder(lean, proposer)
    drafted: list[int] = []
    propose = proposer.propose

    def spy(ctx):
        tree = propose(ctx)
        drafted.extend(int(t) for t in tree.tokens[1:])
        return tree

    proposer.propose = spy
    for prompt in PROMPTS:
        assert decoder.generate(prompt, NEW).tokens == plain_greedy(lean, prompt, NEW)
    assert drafted and set(drafted) <= set(ids.tolist())
    assert proposer.lookahead_top1(torch.randn(5, 64)).shape == (2, 5)


def test_bad_draft_vocabularies_are_refused(target):
    with pytest.raises(ValueError, match="draft_vocab_size must be in 1"):
        MedusaConfig(hidden_size=8, vocab_size=10, draft_vocab_size=11)
    arch = MedusaConfig(
        hidden_size=target.hidden_size, vocab_size=target.vocab_size, draft_vocab_size=4
    )
    with pytest.raises(ValueError, match="needs draft_ids of that length"):
        MedusaHeads(arch, target.lm_head_weight.float())
    with pytest.raises(ValueError, match="target ids in 0"):
        MedusaHeads(
            arch,
            target.lm_head_weight.float(),
            draft_ids=torch.tensor([1, 2, 3, target.vocab_size]),
        )
    cfg = recipe_config("medusa", {"heads": {"draft_vocab_size": -2}})
    with pytest.raises(
        ConfigError, match=r"heads\.draft_vocab_size=-2 is out of range: allowed >= 0"
    ):
        get_recipe("medusa").validate(cfg)
