"""EAGLE-3 training: the loss of each TTT step scores the right tokens against the right teacher
logits, a few steps on a fixed batch lower it, and train.py runs recipe=eagle3 end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_llama
from eagle3_objectives import LAYERS, fixed_batch_steps, make_objective

from draftsmith.distill.target.frozen import Target, TargetFeatures
from draftsmith.export.format import read_export

pytestmark = pytest.mark.unit


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def target(tiny_tokenizer) -> Target:
    return Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")


def two_step_setup(target: Target, length: int) -> tuple:
    """A 2-step TTT objective with a 60-token draft vocabulary and scrambled weights, and random
    inputs for 2 sequences of ``length``: (objective, generator, ids [2, T], layer hidden {i: [2, T,
    H]})."""
    objective = make_objective(target, draft_vocab=60, ttt_steps=2)
    for p in objective.module.parameters():
        p.data.normal_(0, 0.1)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, target.vocab_size, (2, length), generator=g)
    return (
        objective,
        g,
        ids,
        {i: torch.randn(2, length, target.hidden_size, generator=g) for i in LAYERS},
    )


def test_loss_alignment_per_ttt_step(target):
    """Step j, index t: token x_{t+1+j}, teacher logits at t+1+j (draft vocab), label mask at
    t+2+j."""
    objective, g, ids, layers = two_step_setup(target, 8)
    drafter = objective.module
    B, T, V = 2, 8, target.vocab_size
    logits = torch.randn(B, T, V, generator=g)
    draft_ids = drafter.draft_ids_in_target()
    best = draft_ids[
        torch.randint(0, 60, (B, T), generator=g)
    ]  # make the target's argmax draftable ...
    logits.scatter_add_(-1, best[..., None], torch.full((B, T, 1), 8.0))
    out_of_vocab = int((~drafter.t2d).nonzero()[0])
    logits[0, 3, out_of_vocab] = 50.0  # ... except at position 3
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 0]])
    attn = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}
    loss, metrics = objective.loss(batch, TargetFeatures(layer_hidden=layers, logits=logits))

    fused = torch.cat([layers[i] for i in LAYERS], -1)
    total, scored = 0.0, {0: [], 1: []}
    with torch.no_grad():
        for j in range(2):
            terms = []
            for b in range(B):
                for t in range(T - 2 - j):
                    if (
                        not loss_mask[b, t + 2 + j]
                        or not drafter.t2d[logits[b, t + 1 + j].argmax()]
                    ):
                        continue
                    hidden, step_logits, cache = drafter.draft_step(
                        drafter.fuse(fused[b : b + 1, : t + 1]), ids[b : b + 1, 1 : t + 2]
                    )
                    if j == 1:
                        _, step_logits, _ = drafter.draft_step(
                            hidden[:, -1:], ids[b : b + 1, t + 2 : t + 3], cache
                        )
                    p = F.softmax(logits[b, t + 1 + j, draft_ids], -1)
                    terms.append(-(p * F.log_softmax(step_logits[0, -1], -1)).sum())
                    scored[j].append((b, t))
            step_loss = torch.stack(terms).mean()
            torch.testing.assert_close(metrics[f"step{j}/loss"], step_loss, atol=1e-5, rtol=0)
            total = total + 0.8**j * step_loss
    assert scored[0] == [(0, 0), (0, 1), (0, 3), (0, 4), (0, 5), (1, 1), (1, 2), (1, 3), (1, 4)]
    assert scored[1] == [(0, 0), (0, 2), (0, 3), (0, 4), (1, 0), (1, 1), (1, 2), (1, 3)]
    torch.testing.assert_close(loss, total, atol=1e-5, rtol=0)


def test_a_few_steps_lower_the_loss(tiny_tokenizer):
    # A larger init makes the random target's distributions peaked, so the soft-CE floor (entropy)
    # is low.
    target = Target(
        build_tiny_llama(len(tiny_tokenizer), initializer_range=0.2), tiny_tokenizer, "tiny"
    )
    objective = make_objective(target)
    losses, metric_steps = fixed_batch_steps(objective, target)
    metrics = metric_steps[-1]
    assert losses[-1] < 0.75 * losses[0], losses
    assert {"step0/top1", "step1/top1", "step2/top1"} <= set(metrics)


@pytest.mark.e2e  # a train.py / draftsmith subprocess
def test_train_py_end_to_end(tmp_path, tiny_target_dir, tiny_data_file):
    """Hydra composition + Lightning + export for recipe=eagle3, with the draft vocab counted on the
    data."""
    run_dir = tmp_path / "run"
    code = (
        "import sys, runpy; import draftsmith.recipes.eagle3; sys.argv = ['train.py'] +"
        f" sys.argv[1:]; runpy.run_path({str(ROOT / 'train.py')!r}, run_name='__main__')"
    )
    overrides = [
        "recipe=eagle3",
        f"target.name_or_path={tiny_target_dir}",
        "target.dtype=fp32",
        f"data.spec={tiny_data_file}",
        "data.limit=null",
        "data.max_length=48",
        "data.batch_size=4",
        "data.val_fraction=0.1",
        "trainer.max_steps=3",
        "run.checkpoint_every=3",
        "run.final_eval_batches=1",
        "drafter.target_layers=[1,2,3]",
        "drafter.draft_vocab_size=40",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", code, *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "DRAFTSMITH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    config, state = read_export(run_dir / "export")
    assert config["method"] == "eagle3" and config["architecture"]["draft_vocab_size"] == 40
    assert int(state["t2d"].sum()) == 40 and state["lm_head.weight"].shape[0] == 40
