"""Tree verification in bf16 through the fused C++ layer (``kernels/cpu_decoder_layer.cpp``,
``attend_kv_head``) must give each node the logits a one-token step gives it on its own path, bit
for bit: only then is bf16 speculative decoding lossless against bf16 plain decoding. A node that is
not a first child sits at another cache slot than its token has in plain decoding, so any arithmetic
keyed by slot (not by the order of the visible slots) breaks the equality."""

from __future__ import annotations

import pytest
import torch
from conftest import runnable_isas
from test_runtime_model import tiny_model

from draftsmith.kernels import cpu_layer
from draftsmith.runtime.target.model import LeanDecoder

RUNNABLE = runnable_isas()  # fixture `use_variant` in conftest.py
pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not RUNNABLE, reason=str(cpu_layer.why_unavailable())),
]

VOCAB = 203


def _tree(
    path: list[int], decoys: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """A tree whose path nodes each follow a decoy sibling slot: slots [d0, p0, d1, p1, ...] where
    d_i and p_i are both children of p_{i-1} (the root for i = 0). Returns tokens [T], tree_mask [T,
    T], depths [T] and the slots of the path nodes."""
    tokens, parents, path_slots = [], [], []
    parent = -1
    for p, d in zip(path, decoys, strict=True):
        tokens += [d, p]
        parents += [parent, parent]
        path_slots.append(len(tokens) - 1)
        parent = len(tokens) - 1
    t = len(tokens)
    mask = torch.zeros(t, t, dtype=torch.bool)
    depth = torch.zeros(t, dtype=torch.long)
    for i in range(t):
        j, k = i, 0
        while j >= 0:
            mask[i, j] = True
            j, k = parents[j], k + 1
        depth[i] = k - 1
    return torch.tensor(tokens), mask, depth, path_slots


def test_tree_nodes_off_their_plain_slot_match_one_token_steps(tmp_path, use_variant):
    """Path nodes placed after a decoy sibling (so at slots start+1, start+3, ...) get the logits of
    one-token steps along the path, bit for bit, for 40 random paths after one 300-token prompt
    (before the denominator was summed in path order, one path in 15 to 30 differed somewhere); once
    compacted, the next step matches too.
    """
    tiny_model(
        "Llama",
        tmp_path,
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=192,
        num_hidden_layers=4,
        vocab_size=VOCAB,
    )
    model = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend="cpp")
    assert model._ops.layer is use_variant.decoder_layer and model._stack is not None
    gen = torch.Generator().manual_seed(11)
    prompt_len, depth_max = 300, 6
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
    plain, tree = (
        model.allocate_cache(prompt_len + 2 * depth_max + 1),
        model.allocate_cache(prompt_len + 2 * depth_max),
    )
    for cache in (plain, tree):
        model(prompt, cache)
        cache.commit(prompt_len)
    differ = []
    for trial in range(40):
        path = torch.randint(0, VOCAB, (depth_max,), generator=gen).tolist()
        decoys = [(p + 1) % VOCAB for p in path]
        plain.crop(prompt_len)
        tree.crop(prompt_len)
        steps = []
        for token in path + [
            path[0]
        ]:  # the last one: the step after the path, on the compacted cache
            steps.append(model(torch.tensor([token]), plain).logits[0])  # [V]
            plain.commit(1)
        tokens, mask, depth, slots = _tree(path, decoys)
        logits = model(tokens, tree, tree_mask=mask, positions=prompt_len + depth).logits  # [T, V]
        differ += [
            (trial, i) for i, slot in enumerate(slots) if not torch.equal(logits[slot], steps[i])
        ]
        tree.compact(torch.tensor(slots) + prompt_len)
        if not torch.equal(model(torch.tensor([path[0]]), tree).logits[0], steps[-1]):
            differ.append((trial, "next"))
    assert not differ, (
        f"(trial, path node) whose tree-verify logits differ from plain decoding: {differ}"
    )


class SecondChoiceOracle:
    """A drafter that ranks a decoy first and the target's true next token second, so every accepted
    node of a top-2 tree is a second child, off the slot its token has in plain decoding."""

    def __init__(self, sequence: list[int]) -> None:
        self.sequence = sequence

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        nxt = self.sequence[ids.numel()] if ids.numel() < len(self.sequence) else 0
        logits = torch.zeros(VOCAB)
        logits[(nxt + 1) % VOCAB], logits[nxt] = 20.0, 19.0
        return logits


def test_bf16_speculative_decoding_with_second_children_equals_plain_decoding(
    tmp_path, use_variant
):
    """The whole loop in bf16 on the fused layer (tree verify, the argmax head, KV compaction,
    positions): with every accepted node a second child, speculative decoding emits exactly the
    tokens of bf16 plain decoding. (A guard on the loop: a random tiny target's argmax margins are
    too wide for one flipped bf16 value to change a token, so the lane grouping itself is caught by
    the logits test above.)"""
    from draftsmith.runtime.acceptance.verifiers import GreedyVerifier
    from draftsmith.runtime.decoding.autoregressive import generate_ar
    from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
    from draftsmith.runtime.drafting.chain import SampledTreeProposer

    tiny_model(
        "Llama",
        tmp_path,
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=192,
        num_hidden_layers=4,
        vocab_size=VOCAB,
    )
    model = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend="cpp")
    assert model._ops.layer is use_variant.decoder_layer
    prompt = torch.randint(0, VOCAB, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = generate_ar(model, prompt, 64)
    proposer = SampledTreeProposer(
        SecondChoiceOracle(prompt + plain), branching=(2, 2, 2), temperature=0.0
    )
    result = SpeculativeDecoder(model, proposer, GreedyVerifier()).generate(prompt, 64)
    assert result.tokens == plain
    assert sum(result.accepted_per_step) >= 32  # most tokens came through accepted second children
