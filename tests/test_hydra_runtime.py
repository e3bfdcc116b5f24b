"""The Hydra proposer: depth-batched expansion equals expanding one node at a time, and greedy
decoding is lossless."""

from __future__ import annotations

import pytest
import torch
from test_speculative import PROMPTS, plain_greedy, tiny_llama

from draftsmith.common.trees import default_medusa_tree
from draftsmith.heads.hydra import HydraConfig, HydraHeads
from draftsmith.runtime.acceptance.stop_policies import ConfidenceStop
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import StepContext
from draftsmith.runtime.drafting.hydra import HydraProposer

pytestmark = pytest.mark.unit

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, head_scale=8.0)[1]


def random_heads(lean, prefix_layer: bool, seed: int = 0) -> HydraHeads:
    torch.manual_seed(seed)
    h, v = lean.config.hidden_size, lean.config.vocab_size
    extra = (
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128)
        if prefix_layer
        else {}
    )
    heads = HydraHeads(
        HydraConfig(
            hidden_size=h,
            vocab_size=v,
            num_heads=3,
            num_layers=2,
            prefix_layer=prefix_layer,
            **extra,
        ),
        lean.embed_weight,
        lean.lm_head_weight,
    )
    for p in heads.parameters():  # random (not identity-initialised) heads, so every path differs
        p.data.normal_(0, 0.2)
    return heads.eval()


@pytest.mark.parametrize("prefix_layer", [False, True])
def test_depth_batched_expansion_equals_one_node_at_a_time(target, prefix_layer):
    heads = random_heads(target, prefix_layer)
    proposer = HydraProposer(heads, TREE, top_k=3)
    prompt = torch.tensor([1, 5, 9, 2, 7])
    res = target.forward(prompt, target.allocate_cache(8))
    root = int(res.logits[-1].argmax())
    tokens = torch.cat([prompt, torch.tensor([root])])
    proposer.begin(StepContext(tokens=tokens, root_token=root, hidden=res.hidden))
    tree = proposer.propose(StepContext(tokens=tokens, root_token=root, hidden=res.hidden[-1]))
    state = heads.context(res.hidden[None])[0][0, -1] if prefix_layer else res.hidden[-1]  # [H]
    paths = {(): [root]}
    for i, path in enumerate(
        proposer.tree.paths, start=1
    ):  # one node at a time: head len(path)-1 on its own prefix
        prefix = paths[path[:-1]]
        with torch.no_grad():
            logits = heads.step(state[None], torch.tensor([prefix]))[0]  # [V]
        token = int(logits.topk(3).indices[path[-1]])
        assert int(tree.tokens[i]) == token, f"node {i} (path {list(path)})"
        paths[path] = prefix + [token]


@pytest.mark.parametrize("prefix_layer", [False, True])
def test_hydra_greedy_decoding_is_lossless(target, prefix_layer):
    heads = random_heads(target, prefix_layer, seed=1)
    for policy in (None, ConfidenceStop(0.05, max_depth=2)):
        decoder = SpeculativeDecoder(
            target, HydraProposer(heads, default_medusa_tree(3, 10, 3), top_k=3), stop_policy=policy
        )
        for prompt in PROMPTS:
            assert decoder.generate(prompt, 32).tokens == plain_greedy(target, prompt, 32)


class RecordingHeads(torch.nn.Module):
    """Stand-in heads recording the prefixes each head is asked about (head = prefix length - 1)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = HydraConfig(hidden_size=4, vocab_size=vocab, num_heads=3)
        self.prefix, self.calls, self.vocab = None, [], vocab

    def step(self, ctx, prefix):
        self.calls.append(prefix.tolist())
        return (
            torch.nn.functional.one_hot((prefix.sum(-1) + 1) % self.vocab, self.vocab).float() * 5
        )  # [N, V]


def test_each_depth_is_one_call_over_its_frontier_and_each_head_sees_its_path():
    heads = RecordingHeads(50)
    proposer = HydraProposer(heads, [[0], [1], [0, 0], [1, 0], [0, 0, 0]], top_k=2)
    proposer.begin(StepContext(tokens=torch.tensor([3, 4]), root_token=4, hidden=torch.zeros(2, 4)))
    tree = proposer.propose(
        StepContext(tokens=torch.tensor([3, 4]), root_token=4, hidden=torch.zeros(4))
    )
    # depth 1: head 0 on [root]; depth 2: head 1 on both depth-1 nodes at once; depth 3: head 2 on
    # [4, 5, 10]
    assert heads.calls[0] == [[4]]
    first, second = int(tree.tokens[1]), int(tree.tokens[2])
    assert heads.calls[1] == [[4, first], [4, second]]
    assert heads.calls[2] == [[4, first, int(tree.tokens[3])]] and len(heads.calls) == 3


class WeightOnlyLinear(torch.nn.Module):
    """What the packed bf16 GEMM leaves behind: no parameters, the weight as a plain attribute."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = (
            linear.weight.detach(),
            (None if linear.bias is None else linear.bias.detach()),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


def test_heads_without_parameters_after_packing_still_serve_losslessly(target):
    """Regression: plain Hydra heads whose every linear was packed have no parameters left; the
    proposer must still find their dtype (it once asked ``next(parameters())`` and `bench` died with
    an empty StopIteration).
    """
    from draftsmith.runtime.drafting.base import module_dtype

    heads = random_heads(target, prefix_layer=False, seed=2)
    for parent in list(heads.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, WeightOnlyLinear(child))
    assert not list(heads.parameters()) and module_dtype(heads) == torch.float32
    decoder = SpeculativeDecoder(target, HydraProposer(heads, TREE, top_k=3))
    for prompt in PROMPTS:
        assert decoder.generate(prompt, 24).tokens == plain_greedy(target, prompt, 24)
    with pytest.raises(ValueError, match="no floating weights"):
        module_dtype(torch.nn.ReLU())
