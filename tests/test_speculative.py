"""End-to-end speculative decoding on tiny random Llamas (fp32): greedy is token-identical to plain
greedy decoding, with Medusa heads, chains, top-k trees and typical acceptance (exact rejection
sampling: test_speculative_sampling.py)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from torch import nn

from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
from draftsmith.runtime.acceptance.stop_policies import ConfidenceStop
from draftsmith.runtime.acceptance.verifiers import (
    GreedyVerifier,
    TypicalVerifier,
)
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import NullProposer
from draftsmith.runtime.drafting.chain import ChainProposer, DecoderDrafter, SampledTreeProposer
from draftsmith.runtime.drafting.medusa import MedusaProposer
from draftsmith.runtime.target.interface import TargetWrapper
from draftsmith.runtime.target.model import LeanDecoder, ModelConfig

pytestmark = pytest.mark.unit

VOCAB = 96
PROMPTS = [[1, 5, 9], [7], [3, 3, 3, 3, 40, 41, 42, 17, 88, 2, 60]]
NEW = 48


def tiny_llama(
    seed: int, vocab: int = VOCAB, hidden: int = 64, layers: int = 2, head_scale: float = 1.0
):
    """(HF model, LeanDecoder) with the same random weights; ``head_scale`` sharpens the output
    distribution."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.generation_config.eos_token_id = None  # no EOS: generate exactly max_new_tokens
    with torch.no_grad():
        hf.lm_head.weight.mul_(head_scale)
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return (
        hf,
        LeanDecoder(
            ModelConfig.from_hf_dict(cfg.to_dict()), weights, kernel_backend="torch"
        ).eval(),
    )


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, head_scale=8.0)


@pytest.fixture(scope="module")
def reference(target):
    """Plain greedy continuations (one token-forward per step) of every prompt."""
    return {tuple(p): plain_greedy(target[1], p, NEW) for p in PROMPTS}


def plain_greedy(model, prompt, n):
    cache = model.allocate_cache(len(prompt) + n)
    logits = model.forward(torch.tensor(prompt), cache).logits
    cache.commit(len(prompt))
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        logits = model.forward(torch.tensor(out[-1:]), cache).logits
        cache.commit(1)
        out.append(int(logits[-1].argmax()))
    return out


class CountingModel(TargetWrapper):
    """Delegates to a decoder, counting forwards and cache compactions (verification reads the
    logits)."""

    def __init__(self, model):
        super().__init__(model)
        self.model, self.forwards, self.compactions = model, 0, 0
        self.argmax_head = False

    def allocate_cache(self, max_len):
        cache = self.model.allocate_cache(max_len)
        compact = cache.compact

        def counted(*args, **kwargs):
            self.compactions += 1
            return compact(*args, **kwargs)

        cache.compact = counted
        return cache

    def forward(self, *args, **kwargs):
        self.forwards += 1
        return self.model.forward(*args, **kwargs)


class OracleHeads(nn.Module):
    """Medusa stand-in that knows the target's greedy continuation: it finds the position of the
    hidden state it is given and ranks the true token k+2 ahead at rank 0, 1 or (absent) 2, varying
    with position and head, so the accepted path wanders through the tree and the KV cache needs
    real compaction."""

    def __init__(self, model, prompt, continuation, num_heads=3):
        super().__init__()
        self.seq = list(prompt) + list(continuation)
        cache = model.allocate_cache(len(self.seq))
        self.hiddens = model.forward(
            torch.tensor(self.seq), cache
        ).hidden  # [L, H]: h_j predicts seq[j+1]
        self.num_heads = num_heads

    def forward(self, hidden):
        j = int((self.hiddens - hidden).norm(dim=-1).argmin())
        logits = torch.zeros(self.num_heads, VOCAB)
        for k in range(self.num_heads):
            pos = j + k + 2
            truth = self.seq[pos] if pos < len(self.seq) else 0
            # 0, 1, 2, 0, ...: mostly present, sometimes not in the top-2
            rank = (3 * j + k) % 4 % 3
            fillers = [t for t in range(VOCAB) if t != truth][:3]
            order = fillers[:rank] + [truth] + fillers[rank:]
            for r, tok in enumerate(order):
                logits[k, tok] = 10.0 - r
        return logits


MEDUSA_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1], [0, 0, 0], [0, 1, 0], [1, 0, 0]]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_lean_plain_greedy_matches_hf_generate(target, reference, prompt):
    hf, _ = target
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)[
        0, len(prompt) :
    ].tolist()
    assert out == reference[tuple(prompt)]


def test_null_proposer_is_plain_decoding(target, reference):
    model = CountingModel(target[1])
    res = SpeculativeDecoder(model, NullProposer()).generate(PROMPTS[0], NEW)
    assert res.tokens == reference[tuple(PROMPTS[0])]
    assert res.tau == 1.0 and model.forwards == NEW  # prefill + one forward per further token


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_medusa_random_heads_is_lossless(target, reference, prompt):
    torch.manual_seed(1)
    heads = MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=VOCAB, num_heads=3)).eval()
    dec = SpeculativeDecoder(
        target[1], MedusaProposer(heads, MEDUSA_TREE, top_k=2), GreedyVerifier("torch")
    )
    res = dec.generate(prompt, NEW)
    assert res.tokens == reference[tuple(prompt)]
    assert res.steps == len(res.accepted_per_step) and len(res.tokens) == NEW


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_medusa_oracle_heads_accepts_and_compacts(target, reference, prompt):
    model = CountingModel(target[1])
    heads = OracleHeads(target[1], prompt, reference[tuple(prompt)])
    res = SpeculativeDecoder(model, MedusaProposer(heads, MEDUSA_TREE, top_k=2)).generate(
        prompt, NEW
    )
    assert res.tokens == reference[tuple(prompt)]
    assert res.tau > 1.8 and max(res.accepted_per_step) >= 2
    assert model.compactions > 0  # some accepted paths were not the leftmost nodes
    assert model.forwards == res.steps + 1
    assert (
        res.acceptance_by_position[0]
        >= res.acceptance_by_position[1]
        >= res.acceptance_by_position[2]
    )


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_chain_with_second_lm_is_lossless(target, reference, prompt):
    _, drafter_lm = tiny_llama(1, head_scale=8.0)
    dec = SpeculativeDecoder(target[1], ChainProposer(DecoderDrafter(drafter_lm, 256), depth=3))
    res = dec.generate(prompt, NEW)
    assert res.tokens == reference[tuple(prompt)]


def test_greedy_chain_with_perfect_drafter_has_tau_depth_plus_one(target, reference):
    depth = 4
    model = CountingModel(target[1])
    dec = SpeculativeDecoder(model, ChainProposer(DecoderDrafter(target[1], 256), depth=depth))
    res = dec.generate(PROMPTS[2], NEW)
    assert res.tokens == reference[tuple(PROMPTS[2])]
    assert res.tau == depth + 1 and set(res.accepted_per_step) == {depth}
    assert res.acceptance_by_position == [1.0] * depth
    assert model.compactions == 0  # a chain's accepted prefix is already in place
    assert model.forwards == 1 + math.ceil((NEW - 1) / (depth + 1))


def test_greedy_noisy_chain_and_topk_tree_are_lossless(target, reference):
    prompt = PROMPTS[0]
    inner = DecoderDrafter(target[1], 256)

    def noisy(ids):  # right most of the time, deterministically wrong every third length
        logits = inner(ids)
        return logits.roll(1) if len(ids) % 3 == 0 else logits

    res = SpeculativeDecoder(target[1], ChainProposer(noisy, depth=4)).generate(prompt, NEW)
    assert res.tokens == reference[tuple(prompt)]
    assert 1.5 < res.tau < 5.0
    # EAGLE-2-style top-k tree from the same drafter, with a confidence stop.
    dec = SpeculativeDecoder(
        target[1],
        SampledTreeProposer(noisy, (2, 2, 1), temperature=0.0),
        stop_policy=ConfidenceStop(0.2, max_depth=3),
    )
    res = dec.generate(prompt, NEW)
    assert res.tokens == reference[tuple(prompt)] and res.tau > 1.5


def test_eos_and_stream(target, reference):
    ref = reference[tuple(PROMPTS[1])]
    first = next(
        i for i, t in enumerate(ref) if i >= 5 and ref.index(t) == i
    )  # a token first seen late
    eos = ref[first]
    chunks = []
    dec = SpeculativeDecoder(target[1], ChainProposer(DecoderDrafter(target[1], 256), depth=3))
    res = dec.generate(PROMPTS[1], NEW, eos_ids=(eos,), stream=chunks.append)
    assert res.tokens == ref[: first + 1]
    assert [t for c in chunks for t in c] == res.tokens and len(chunks) > 1
    # max_new_tokens cuts inside an accepted chain
    assert dec.generate(PROMPTS[1], 5).tokens == ref[:5]


def test_typical_verifier_accepts_by_the_entropy_threshold_where_greedy_rejects():
    """Typical acceptance keeps a drafted token x when p(x) > min(posterior_threshold,
    posterior_alpha * exp(-H(p))), with p the target distribution at the verifier's temperature. The
    same p(x) = 0.08 is typical after a flat row (the entropy bound, 0.3 * exp(-1.917) = 0.044, is
    the lower one) and atypical after a peaked row (the constant 0.09 is); greedy keeps only argmax
    tokens."""
    from draftsmith.runtime.drafting.tree import DraftTree

    flat = [0.20, 0.15, 0.15, 0.15, 0.15, 0.12, 0.08]  # argmax 0; token 6 has p = 0.08
    peaked = [0.70, 0.08, 0.06, 0.05, 0.05, 0.03, 0.03]  # argmax 0; token 1 has p = 0.08

    def threshold(
        p: list[float], alpha: float, constant: float = 0.09
    ) -> float:  # the documented rule, by hand
        entropy = -sum(x * math.log(x + 1e-5) for x in p)
        return min(constant, alpha * math.exp(-entropy))

    assert threshold(flat, 0.3) < 0.08 < threshold(flat, 0.6) < 0.09 == threshold(peaked, 0.3)
    # node: token (parent) -> row of target probabilities after it
    #   0: root          -> flat
    #   1: 6 (0)  p=0.08 under flat: typical, not argmax     -> peaked
    #   2: 0 (0)  argmax of flat                             -> peaked
    #   3: 0 (1)  argmax of peaked                           -> flat
    #   4: 1 (2)  p=0.08 under peaked: atypical              -> flat
    #   5: 6 (3)  p=0.08 under flat: typical                 -> peaked
    tree = DraftTree.from_parents([0, 6, 0, 0, 1, 6], [-1, 0, 0, 1, 2, 3])
    rows = [flat, peaked, peaked, flat, flat, peaked]
    temperature = 0.7
    logits = temperature * torch.log(
        torch.tensor(rows, dtype=torch.float64)
    )  # softmax(logits / T) = rows

    typical = TypicalVerifier(temperature=temperature).verify(tree, logits)
    assert (typical.path_nodes, typical.accepted_tokens, typical.bonus_token) == (
        [0, 1, 3, 5],
        [6, 0, 6],
        0,
    )
    assert typical.num_accepted == 3
    greedy = GreedyVerifier("torch").verify(tree, logits)
    assert (greedy.path_nodes, greedy.accepted_tokens, greedy.bonus_token) == ([0, 2], [0], 0)
    # A larger alpha lifts the flat row's bound above 0.08 (0.6 * exp(-1.917) = 0.088): node 1
    # becomes atypical, node 4 stays so. Read at T = 1 instead of 0.7, the flat row would be flatter
    # still and node 1 typical again.
    strict = TypicalVerifier(posterior_alpha=0.6, temperature=temperature).verify(tree, logits)
    assert (strict.path_nodes, strict.accepted_tokens, strict.num_accepted) == ([0, 2], [0], 1)


def test_build_proposer_from_medusa_export(target, reference, tmp_path):
    from draftsmith.export.format import write_export
    from draftsmith.runtime.drafting.registry import build_proposer, registered_methods

    torch.manual_seed(2)
    heads = MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=VOCAB, num_heads=2))
    config = {
        "method": "medusa",
        "architecture": heads.architecture(),
        "target": {"name_or_path": "tiny"},
        "inference": {"tree": [[0], [1], [0, 0]], "top_k": 2, "verifier": "greedy"},
    }
    write_export(tmp_path / "medusa", heads.trainable_state_dict(), config)
    proposer = build_proposer(tmp_path / "medusa", target[1])
    assert isinstance(proposer, MedusaProposer) and proposer.max_tree_nodes == 4
    assert (
        SpeculativeDecoder(target[1], proposer).generate(PROMPTS[0], NEW).tokens
        == reference[tuple(PROMPTS[0])]
    )
    assert "medusa" in registered_methods()
    write_export(tmp_path / "other", {"w": torch.zeros(1)}, {**config, "method": "no-such-method"})
    with pytest.raises(
        ValueError, match="method 'no-such-method' is not a method draftsmith has"
    ):  # the schema's
        build_proposer(tmp_path / "other", target[1])
    # a method draftsmith reads but serves no proposer for (the adapted target) is refused by the
    # registry
    write_export(
        tmp_path / "target", {"w": torch.zeros(1)}, {**config, "method": "diffusion_adapt"}
    )
    with pytest.raises(ValueError, match="no runtime proposer for method 'diffusion_adapt'"):
        build_proposer(tmp_path / "target", target[1])


def test_errors(target):
    model = CountingModel(target[1])
    dec = SpeculativeDecoder(
        model, ChainProposer(DecoderDrafter(target[1], 256), depth=4), max_cache_len=64
    )
    with pytest.raises(ValueError, match="prompt is empty"):
        dec.generate([], 10)
    with pytest.raises(ValueError, match="need 75 cache slots but the limit is 64"):
        dec.generate(list(range(50)), 20)
    assert model.forwards == 0  # refused before any work
    with pytest.raises(ValueError, match="unknown kernel backend 'gpu'"):
        SpeculativeDecoder(model, NullProposer(), kernel_backend="gpu")
    # No cap unless given: the cache is sized from the request; a prompt is refused by the target's
    # context alone, with the message of the CLI's up-front check
    # (runtime/decoding/prompt_limits.py)
    with pytest.raises(ValueError, match="at most 255 tokens"):
        SpeculativeDecoder(target[1], NullProposer()).generate([i % 96 for i in range(256)], 4)
