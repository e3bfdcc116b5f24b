"""``trainer.compile``: the target forward on packed rows and EAGLE-3's TTT + loss trace into one
graph each (no graph break), and the compiled step computes the eager step's loss and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import build_tiny_llama
from test_eagle3 import make_objective

from draftsmith.distill.data.packing import collate_packed
from draftsmith.distill.engine.compiled import CompiledStep
from draftsmith.distill.target.frozen import Target

pytestmark = pytest.mark.unit


@pytest.fixture()
def setup(tiny_tokenizer):
    target = Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")
    objective = make_objective(target, draft_vocab=60, ttt_steps=3)
    objective.module.train()
    rng = np.random.default_rng(0)
    rows = [
        {
            "input_ids": rng.integers(5, 60, 22),
            "loss_mask": np.ones(22, dtype=int),
            "document_lengths": [9, 13],
        },
        {
            "input_ids": rng.integers(5, 60, 17),
            "loss_mask": np.ones(17, dtype=int),
            "document_lengths": [17],
        },
    ]
    return target, objective, collate_packed(rows, 24, pad_id=1)


def features(target, objective, batch):
    return target.features(
        batch["input_ids"],
        batch["attention_mask"],
        objective.taps,
        position_ids=batch["position_ids"],
        document_ids=batch["document_ids"],
    )


def test_the_target_forward_and_the_ttt_loss_trace_without_a_graph_break(setup):
    target, objective, batch = setup
    torch._dynamo.reset()
    feats = features(
        target, objective, batch
    )  # eager once: transformers installs its hooks (CompiledStep does too)
    forward = torch._dynamo.explain(lambda b: features(target, objective, b))(batch)
    assert (forward.graph_count, forward.graph_break_count) == (1, 0), [
        r.reason for r in forward.break_reasons
    ]
    loss = torch._dynamo.explain(objective.loss)(batch, feats)
    assert (loss.graph_count, loss.graph_break_count) == (1, 0), [
        r.reason for r in loss.break_reasons
    ]


def test_a_compiled_step_computes_the_eager_loss_and_gradients(setup):
    target, objective, batch = setup
    torch._dynamo.reset()
    step = CompiledStep(enabled=True, backend="aot_eager")
    params = [p for p in objective.module.parameters() if p.requires_grad]
    results = []
    for _ in range(3):  # eager, then compiled twice (the second compiled call reuses the graph)
        feats_fn, loss_fn = step.parts(target, objective)
        loss, metrics = loss_fn(
            batch,
            feats_fn(
                batch["input_ids"],
                batch["attention_mask"],
                objective.taps,
                position_ids=batch["position_ids"],
                document_ids=batch["document_ids"],
            ),
        )
        results.append((loss.detach(), metrics["step2/top1"], torch.autograd.grad(loss, params)))
    assert step.features is not None and step.loss is not None
    # the compiled loss still hands its counts to the guards
    assert float(objective.last_scored) > 0
    for loss, top1, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(top1, results[0][1])
        for a, b in zip(grads, results[0][2]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    eager = CompiledStep(enabled=False)
    assert eager.parts(target, objective) == (target.features, objective.loss)
