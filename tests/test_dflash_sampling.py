"""DFlash's sampled blocks under exact rejection sampling: on a small sharpened target, the
speculative decoder's output distribution is the target's (chi-square over thousands of decodes),
and the same test flags a proposer that records a draft law other than the one it sampled from."""

from __future__ import annotations

import pytest
import torch
import transformers
from test_eagle_runtime import lean_from_hf
from test_eagle_sampling import ALPHA, assert_matches, exact_law, sample_counts
from test_speculative_sampling import chi2_pvalue

from draftsmith.drafters.dflash import DFlashConfig, DFlashDrafter
from draftsmith.runtime.acceptance.rejection_sampling import RejectionSamplingVerifier
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.dflash import DFlashProposer

pytestmark = pytest.mark.unit


class MisrecordedQ(DFlashProposer):
    """A deliberate bug: samples from a sharp q but records a flat one."""

    @staticmethod
    def _recorded_law(q):
        return torch.full_like(q, 1.0 / q.numel()).double().cpu()


def small_dflash(proposer_cls: type = DFlashProposer, **options):
    """A 2-layer V=8 target with a sharpened head and an opinionated random DFlash drafter (block 3,
    Markov head)."""
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(
        vocab_size=8,
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
    arch = DFlashConfig(
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=8,
        target_hidden_size=32,
        block_size=3,
        mask_token_id=6,
        target_layers=(0, 1),
        markov_head=True,
        markov_rank=4,
    )
    drafter = DFlashDrafter(arch, lean.embed_weight, lean.lm_head_weight)
    for p in drafter.parameters():
        p.data.normal_(0, 0.3)  # opinionated drafts: some accepted, many rejected
    return hf, lean, proposer_cls(drafter, **options)


# thousands of whole sampled decodes for a chi-square: over 5 s, so not in the unit tier
@pytest.mark.e2e
def test_rejection_sampling_with_sampled_dflash_blocks_preserves_the_distribution():
    hf, lean, proposer = small_dflash(temperature=0.6, top_p=0.9)
    dec = SpeculativeDecoder(lean, proposer, RejectionSamplingVerifier(temperature=0.8, top_p=0.95))
    assert_matches(sample_counts(dec, 2000, seed=1), exact_law(hf, 0.8, 0.95))


@pytest.mark.e2e  # hundreds of whole sampled decodes
def test_chi_square_flags_a_misrecorded_draft_law():
    hf, lean, proposer = small_dflash(MisrecordedQ, temperature=0.3)
    dec = SpeculativeDecoder(lean, proposer, RejectionSamplingVerifier(temperature=1.0))
    counts, exact = sample_counts(dec, 800, seed=2), exact_law(hf, 1.0, 1.0)
    assert (
        min(chi2_pvalue(counts.sum(2), exact.sum(2)), chi2_pvalue(counts.sum(0), exact.sum(0)))
        < ALPHA
    )
