"""EAGLE-1 / EAGLE-3 runtime, exact rejection sampling: dynamic trees and sampled EAGLE-3 chains
(reduced draft vocabulary) keep the target's law of its first three sampled tokens (chi-square), and
the test has power against a proposer that misrecords its draft law."""

from __future__ import annotations

import pytest
import torch
import transformers
from test_eagle_runtime import lean_from_hf
from test_speculative_sampling import chi2_pvalue  # one chi-square test for every sampling check

from draftsmith.drafters.eagle import EagleConfig, EagleDrafter
from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from draftsmith.drafters.vocab import vocab_maps
from draftsmith.runtime.acceptance.rejection_sampling import RejectionSamplingVerifier
from draftsmith.runtime.acceptance.verifiers import target_probs
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.eagle_adapters import Eagle1DraftModel, Eagle3DraftModel
from draftsmith.runtime.drafting.eagle_proposer import EagleProposer

pytestmark = pytest.mark.unit

ALPHA = 1e-4  # strict: the exact sampler must not be flagged by chance (seeds are fixed anyway)
SMALL_V = 8
SMALL_PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def small():
    """A 2-layer V=8 Llama with a sharpened head, its HF twin, and random EAGLE-1 / EAGLE-3 (6-token
    vocab) drafters."""
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(
        vocab_size=SMALL_V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(10.0)
    lean = lean_from_hf(hf)
    dims = EagleConfig.dims_from_hf(cfg)
    e1 = EagleDrafter(EagleConfig(**dims), lean.embed_weight, lean.lm_head_weight)
    d2t, t2d = vocab_maps(torch.tensor([0, 1, 2, 4, 5, 7]), SMALL_V)
    e3 = Eagle3Drafter(
        Eagle3Config(**dims, draft_vocab_size=6, target_layers=(0, 1)), lean.embed_weight, d2t, t2d
    )
    for p in [*e1.parameters(), *e3.parameters()]:
        p.data.normal_(0, 0.3)  # opinionated drafts: some accepted, many rejected
    return hf, lean, Eagle1DraftModel(e1), Eagle3DraftModel(e3)


def exact_law(hf, temperature: float, top_p: float) -> torch.Tensor:
    """P(t1, t2, t3) [V, V, V] of the target's first three sampled tokens after SMALL_PROMPT."""
    v = SMALL_V
    with torch.no_grad():
        p1 = target_probs(hf(torch.tensor([SMALL_PROMPT])).logits[0, -1], temperature, top_p)  # [V]
        ctx2 = torch.tensor([SMALL_PROMPT + [a] for a in range(v)])
        p2 = target_probs(hf(ctx2).logits[:, -1], temperature, top_p)  # [V, V]
        ctx3 = torch.tensor([SMALL_PROMPT + [a, b] for a in range(v) for b in range(v)])
        p3 = target_probs(hf(ctx3).logits[:, -1], temperature, top_p).view(v, v, v)
    return p1[:, None, None] * p2[:, :, None] * p3


def sample_counts(decoder: SpeculativeDecoder, n: int, seed: int) -> torch.Tensor:
    counts = torch.zeros(SMALL_V, SMALL_V, SMALL_V)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        t1, t2, t3 = decoder.generate(SMALL_PROMPT, 3, generator=gen).tokens
        counts[t1, t2, t3] += 1
    return counts


def assert_matches(counts: torch.Tensor, exact: torch.Tensor) -> None:
    assert float(counts[exact == 0].sum()) == 0  # nothing outside the top-p nucleus
    assert chi2_pvalue(counts.sum(2), exact.sum(2)) > ALPHA  # (t1, t2)
    # (t2, t3): acceptance below depth 1 matters too
    assert chi2_pvalue(counts.sum(0), exact.sum(0)) > ALPHA


# thousands of whole sampled decodes for a chi-square: over 5 s, so not in the unit tier
@pytest.mark.e2e
def test_rejection_sampling_with_dynamic_trees_preserves_the_distribution(small):
    hf, lean, e1, _ = small
    proposer = EagleProposer(e1, "tree", total_tokens=7, depth=2, top_k=3)
    dec = SpeculativeDecoder(lean, proposer, RejectionSamplingVerifier(temperature=1.0))
    counts = sample_counts(dec, 2000, seed=0)
    assert_matches(counts, exact_law(hf, 1.0, 1.0))


# thousands of whole sampled decodes for a chi-square: over 5 s, so not in the unit tier
@pytest.mark.e2e
def test_rejection_sampling_with_sampled_eagle3_chains_preserves_the_distribution(small):
    hf, lean, _, e3 = small
    proposer = EagleProposer(e3, "chain", depth=1, temperature=0.6, top_p=0.9)
    dec = SpeculativeDecoder(lean, proposer, RejectionSamplingVerifier(temperature=0.8, top_p=0.95))
    counts = sample_counts(dec, 2000, seed=1)
    assert_matches(counts, exact_law(hf, 0.8, 0.95))


class MisrecordedQ(EagleProposer):
    """A deliberate bug: samples from a sharp q but records a flat one (uniform over the draft
    vocabulary)."""

    def _on_target_vocab(self, q):
        return super()._on_target_vocab(torch.full_like(q, 1.0 / q.numel()))


def test_chi_square_has_power_against_a_wrong_draft_law(small):
    hf, lean, e1, _ = small
    proposer = MisrecordedQ(e1, "chain", depth=1, temperature=0.3)
    dec = SpeculativeDecoder(lean, proposer, RejectionSamplingVerifier(temperature=1.0))
    counts = sample_counts(dec, 800, seed=2)
    exact = exact_law(hf, 1.0, 1.0)
    assert (
        min(chi2_pvalue(counts.sum(2), exact.sum(2)), chi2_pvalue(counts.sum(0), exact.sum(0)))
        < ALPHA
    )
