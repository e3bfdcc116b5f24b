"""The memory model of docs/CLUSTER.md against what a CPU training step of tiny EAGLE-3 drafters
really holds: the drafter's parameter count exactly, the activation bytes autograd saves for the
backward within 15 %.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_llama

from draftsmith import recipes
from draftsmith.cli.training import compose_config
from draftsmith.distill.cluster.memory_model import (
    PRESETS,
    TARGETS,
    Shape,
    activation_bytes_per_token,
    eagle3_params,
    largest_fitting,
    memory_per_gpu,
)
from draftsmith.distill.target.frozen import Target

pytestmark = pytest.mark.unit

TTT = 3


def tiny(tokenizer, hidden: int, intermediate: int, vocab: int):
    model = build_tiny_llama(vocab, hidden_size=hidden, intermediate_size=intermediate)
    c = model.config
    shape = Shape(
        "tiny",
        sum(p.numel() for p in model.parameters()),
        hidden,
        c.num_hidden_layers,
        vocab,
        intermediate,
        c.num_attention_heads,
        c.num_key_value_heads,
        tied_embeddings=True,
    )
    return Target(model, tokenizer, "tiny"), shape


def saved_activation_bytes(objective, target, batch) -> int:
    """Bytes of the distinct storages autograd saves in one loss forward, minus weights, buffers and
    target features."""
    feats = target.features(batch["input_ids"], batch["attention_mask"], objective.taps)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = objective.loss(batch, feats)
    loss.backward()  # the graph was complete
    inputs = [
        *objective.module.parameters(),
        *objective.module.buffers(),
        *feats.layer_hidden.values(),
        feats.logits,
        feats.final_hidden,
        feats.head_weight,
    ]  # the logits, or the head the teacher comes from
    skip = {t.untyped_storage().data_ptr() for t in inputs if t is not None}
    return sum(n for ptr, n in seen.items() if ptr not in skip)


@pytest.mark.parametrize(
    "hidden,intermediate,vocab", [(64, 128, 120), (64, 128, 2120), (128, 352, 120)]
)
def test_drafter_params_exact_and_activation_model_within_15_percent(
    tiny_tokenizer, hidden, intermediate, vocab
):
    target, shape = tiny(tiny_tokenizer, hidden, intermediate, vocab)
    cfg = compose_config(
        [
            "recipe=eagle3",
            "drafter.target_layers=[1,2,3]",
            "drafter.draft_vocab_size=0",
            f"drafter.ttt_steps={TTT}",
        ]
    )
    objective = recipes.get_recipe("eagle3").build(cfg, target)
    assert sum(p.numel() for p in objective.module.parameters()) == eagle3_params(shape, vocab)

    ids = torch.randint(5, len(tiny_tokenizer), (2, 64), generator=torch.Generator().manual_seed(0))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
    }
    measured = saved_activation_bytes(objective, target, batch) / ids.numel()
    predicted = activation_bytes_per_token(shape, vocab, TTT, elem_bytes=4)  # fp32 on CPU
    assert abs(measured - predicted) / measured < 0.15, (measured, predicted)


def test_memory_model_orders_presets_as_expected():
    big = TARGETS["llama-3.1-70b"]
    by_preset = {p: memory_per_gpu(big, p)["total"] for p in PRESETS}
    assert by_preset["fsdp+shard"] < by_preset["fsdp"] < by_preset["ddp"]
    assert memory_per_gpu(big, "zero3", offload_optimizer=True)["total"] < by_preset["zero3"]
    assert (
        memory_per_gpu(big, "ddp", checkpointing=True)["activations"]
        < memory_per_gpu(big, "ddp")["activations"]
    )
    assert (
        largest_fitting("ddp") == "Llama-3.1-8B"
        and largest_fitting("fsdp+shard") == "Llama-3.1-70B"
    )
    with pytest.raises(ValueError, match="valid: ddp, fsdp"):
        memory_per_gpu(big, "tp")
