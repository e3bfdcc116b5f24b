"""DFlash slot 1, served: on a target whose next token is a fixed function of the current one (a
permutation cycle), a drafter whose training says slot 1 is always right must be accepted at slot 1
in the runtime's own speculative loop (load_runtime on the export), on the sequences it trained on.
Any disagreement between the training blocks and the served block (what slot 0 holds, which context
positions a block sees, the label each slot is scored against, the RoPE positions) shows here as
served slot-1 acceptance far below training's top-1 (issue 39).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_tiny_llama, train_on_fixed_batch
from recipe_configs import recipe_config

from draftsmith.distill.target.frozen import Target
from draftsmith.export.format import write_export
from draftsmith.recipes.dflash.build import build_objective
from draftsmith.runtime.serving import load_runtime

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
FIRST_WORD = 5  # ids below are the tiny tokenizer's specials (mask = 1, <pad>)
SEQ_LEN, STRIDE, PROMPT_LEN = 24, 8, 5


def cycle_of(vocab: int) -> list[int]:
    """A fixed random order of the word ids: the target's next token after ``cycle[i]`` is
    ``cycle[i+1]``."""
    return (
        torch.randperm(vocab - FIRST_WORD, generator=torch.Generator().manual_seed(0)) + FIRST_WORD
    ).tolist()


def cycle_target(folder: Path, tokenizer, cycle: list[int]) -> Path:
    """A tiny Llama whose greedy next token follows ``cycle``, built by hand (no training): every
    layer's output projections are zero, so the residual stream is the token's embedding, and the
    LM-head row of ``next(v)`` is ``embedding(v)`` (equal-norm embeddings: the dot product peaks at
    the token itself)."""
    vocab = len(tokenizer)
    hf = build_tiny_llama(vocab, tie_word_embeddings=False)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        # [V, H]
        emb = torch.nn.functional.normalize(torch.randn(vocab, hf.config.hidden_size), dim=-1) * 8.0
        head = torch.zeros_like(emb)
        for i, token in enumerate(cycle):
            head[cycle[(i + 1) % len(cycle)]] = emb[token]
        hf.model.embed_tokens.weight.copy_(emb)
        hf.lm_head.weight.copy_(head)
    hf.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def walk(cycle: list[int], start: int, length: int) -> list[int]:
    """``length`` tokens of the cycle from position ``start``."""
    return [cycle[(start + i) % len(cycle)] for i in range(length)]


@pytest.fixture(scope="module")
def trained(tiny_tokenizer, tmp_path_factory):
    """(target folder, export, training's slot-1 top-1, cycle): DFlash trained 100 steps on windows
    of the cycle."""
    from transformers import AutoModelForCausalLM

    cycle = cycle_of(len(tiny_tokenizer))
    folder = cycle_target(tmp_path_factory.mktemp("cycle") / "target", tiny_tokenizer, cycle)
    target = Target(
        AutoModelForCausalLM.from_pretrained(folder).eval(), tiny_tokenizer, str(folder)
    )
    ids = torch.tensor(
        [walk(cycle, s, SEQ_LEN) for s in range(0, len(cycle), STRIDE)]
    )  # [N, T]: every transition
    ones = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones.clone()}
    cfg = recipe_config(
        "dflash",
        {
            "drafter": {
                "target_layers": [1, 2, 3],
                "block_size": 5,
                "mask_token_id": 1,
                "num_layers": 1,
                "anchors_per_seq": 8,
            }
        },
    )
    torch.manual_seed(0)
    objective = build_objective(cfg, target, [(ids, ones)])
    feats = target.features(ids, ones, objective.taps)
    train_on_fixed_batch(objective, batch, feats, steps=100, lr=3e-3)
    with torch.no_grad():
        _, metrics = objective.loss(
            batch, feats
        )  # training's own verdict on slot 1, after the last step
    objective.module.eval()
    config = {**objective.export_config(), "target": target.identity(), "training": {"steps": 100}}
    export = write_export(folder.parent / "export", objective.module.state_dict(), config)
    return folder, export, float(metrics["slot1/top1"]), cycle


def test_the_hand_built_target_follows_its_cycle(trained):
    from transformers import AutoModelForCausalLM

    folder, _, _, cycle = trained
    ids = torch.tensor([walk(cycle, 3, 30)])  # [1, 30]
    # [1, 30]
    greedy = AutoModelForCausalLM.from_pretrained(folder).eval()(input_ids=ids).logits.argmax(-1)
    assert greedy[0, :-1].tolist() == ids[0, 1:].tolist()


def test_served_slot1_acceptance_matches_training(trained):
    """Training says slot 1 is right on every block; the runtime must accept slot 1 on (nearly)
    every step of the sequences trained on, and emit exactly the cycle (lossless greedy)."""
    folder, export, train_top1, cycle = trained
    assert train_top1 >= 0.95, (
        f"the drafter did not learn the cycle (training slot-1 top-1 {train_top1:.2f})"
    )
    runtime = load_runtime(str(export), str(folder))
    slot1, taus = [], []
    for start in range(0, len(cycle), STRIDE):
        prompt = walk(cycle, start, PROMPT_LEN)
        res = runtime.speculative.generate(torch.tensor(prompt), SEQ_LEN - PROMPT_LEN)
        assert res.tokens == walk(cycle, start + PROMPT_LEN, len(res.tokens))
        slot1.append(res.acceptance_by_position[0])
        taus.append(res.tau)
    mean = sum(slot1) / len(slot1)
    assert mean >= 0.9, (
        f"served slot-1 acceptance {mean:.2f} (per prompt {[round(x, 2) for x in slot1]}) while "
        f"training's slot-1 top-1 is {train_top1:.2f}: training and serving disagree"
    )
    assert sum(taus) / len(taus) >= 3.5, taus
