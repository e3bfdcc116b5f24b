"""Speculative sampling stays exact: tree rejection sampling on a tiny random Llama (fp32) and on a
synthetic target reproduces the target's distribution (chi-square against the exact distribution),
with and without replacement, at temperatures and top-p, and the chi-square test has power against a
wrong sampler."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_speculative import tiny_llama

from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
from draftsmith.runtime.acceptance.rejection_sampling import RejectionSamplingVerifier
from draftsmith.runtime.acceptance.verifiers import Acceptance, target_probs
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import StepContext
from draftsmith.runtime.drafting.chain import SampledTreeProposer
from draftsmith.runtime.drafting.medusa import MedusaProposer

pytestmark = pytest.mark.unit


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of ``counts`` against ``probs`` (cells with expected < 5 pooled
    into one)."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if bool(((obs > 0) & (exp <= 0)).any()):
        return 0.0
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2)
    )  # chi2 survival


ALPHA = 1e-4  # strict: the correct sampler must not be flagged by chance (seeds are fixed anyway)
SMALL_V = 8


@pytest.fixture(scope="module")
def small_target():
    """A 1-layer V=8 Llama with a sharpened (but not peaked) head, and the exact law of its first
    two sampled tokens."""
    hf, lean = tiny_llama(3, vocab=SMALL_V, hidden=32, layers=1, head_scale=10.0)
    prompt = [1, 2, 3]
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)  # [V]
        ctx2 = torch.tensor([prompt + [a] for a in range(SMALL_V)])
        p2 = torch.softmax(hf(ctx2).logits[:, -1].double(), -1)  # [V, V]
    return lean, prompt, p1[:, None] * p2  # law of (t1, t2)


def bigram_drafter(seed: int, scale: float = 2.0):
    table = torch.randn(SMALL_V, SMALL_V, generator=torch.Generator().manual_seed(seed)) * scale
    return lambda ids: table[ids[-1]]


def sample_counts(decoder, prompt, n, seed):
    """Counts of (t1, t2) over ``n`` generations: t1 comes from the prefill, t2 from verifying the
    first tree."""
    counts = torch.zeros(SMALL_V, SMALL_V)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        t1, t2 = decoder.generate(prompt, 2, generator=gen).tokens
        counts[t1, t2] += 1
    return counts


class ForgetsResidual(RejectionSamplingVerifier):
    """A classic bug: after rejecting every child, draw the bonus from the target p instead of the
    residual."""

    def verify(self, tree, logits, generator=None):
        acc = super().verify(tree, logits, generator)
        last = acc.path_nodes[-1]
        if tree.children(
            last
        ):  # its children were all rejected: resample from the full target instead
            p = target_probs(logits[last], self.temperature, self.top_p)
            return dataclasses.replace(
                acc, bonus_token=int(torch.multinomial(p, 1, generator=generator))
            )
        return acc


# thousands of whole sampled decodes for a chi-square: over 5 s, so not in the unit tier
@pytest.mark.e2e
def test_rejection_sampling_with_replacement_tree_preserves_distribution(small_target):
    lean, prompt, joint = small_target
    dec = SpeculativeDecoder(
        lean,
        SampledTreeProposer(bigram_drafter(0), (2, 2), temperature=1.0),
        RejectionSamplingVerifier(temperature=1.0),
    )
    assert chi2_pvalue(sample_counts(dec, prompt, 4000, seed=0), joint) > ALPHA


# thousands of whole sampled decodes for a chi-square: over 5 s, so not in the unit tier
@pytest.mark.e2e
def test_rejection_sampling_point_mass_medusa_tree_preserves_distribution(small_target):
    lean, prompt, joint = small_target
    torch.manual_seed(5)
    heads = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=SMALL_V, num_heads=2)).eval()
    proposer = MedusaProposer(heads, [[0], [1], [2], [0, 0], [0, 1], [1, 0]], top_k=3)
    dec = SpeculativeDecoder(lean, proposer, RejectionSamplingVerifier(temperature=1.0))
    assert chi2_pvalue(sample_counts(dec, prompt, 4000, seed=1), joint) > ALPHA


def test_chi_square_has_power_against_a_wrong_sampler(small_target):
    lean, prompt, joint = small_target
    dec = SpeculativeDecoder(
        lean,
        SampledTreeProposer(bigram_drafter(0), (2, 2), temperature=1.0),
        ForgetsResidual(temperature=1.0),
    )
    assert chi2_pvalue(sample_counts(dec, prompt, 1500, seed=2), joint) < ALPHA


# Decoder-free loop over a synthetic target (logits: a fixed random table indexed by the last two
# tokens): cheap enough to check the first THREE tokens (so acceptance below the root's children
# matters too), sampling without replacement, temperature and top-p.

# [prev2, prev1, V]
SYNTH = torch.randn(SMALL_V, SMALL_V, SMALL_V, generator=torch.Generator().manual_seed(11)) * 2.0


def synthetic_logits(ctx: list[int]) -> torch.Tensor:
    return SYNTH[ctx[-2], ctx[-1]]


def first_tokens(proposer, verifier, prompt, n, gen):
    """Run the speculative loop (propose -> target logits per node -> verify) until ``n`` tokens are
    out."""
    out = [verifier.sample(synthetic_logits(prompt), gen)]
    while len(out) < n:
        ctx = prompt + out
        tree = proposer.propose(
            StepContext(
                tokens=torch.tensor(ctx), root_token=out[-1], hidden=torch.zeros(1), generator=gen
            )
        )
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        node_ctx = [ctx]
        for i in range(1, len(tokens)):
            node_ctx.append(node_ctx[parents[i]] + [tokens[i]])
        logits = torch.stack(
            [synthetic_logits(c) for c in node_ctx]
        )  # [N, V]: row i predicts after node i
        acc: Acceptance = verifier.verify(tree, logits, gen)
        out += acc.accepted_tokens + [acc.bonus_token]
    return out[:n]


class PointMassTreatment(RejectionSamplingVerifier):
    """Treats sampled children as point masses (EAGLE-2's rule). This is still exact - the
    point-mass rule is exact for any child chosen independently of the target's coin flips - only
    less efficient."""

    def verify(self, tree, logits, generator=None):
        return super().verify(
            dataclasses.replace(tree, draft_q=None, draft_mode="point_mass"), logits, generator
        )


@pytest.mark.parametrize(
    "mode, verifier_cls, temperature, top_p",
    [
        ("without_replacement", RejectionSamplingVerifier, 1.0, 1.0),
        ("with_replacement", RejectionSamplingVerifier, 0.7, 0.9),
        ("without_replacement", PointMassTreatment, 1.0, 1.0),
    ],
)
def test_rejection_sampling_modes_on_synthetic_target(mode, verifier_cls, temperature, top_p):
    proposer = SampledTreeProposer(
        bigram_drafter(1),
        (3, 2),
        temperature=temperature,
        top_p=top_p,
        replacement=mode == "with_replacement",
    )
    verifier = verifier_cls(temperature=temperature, top_p=top_p)
    gen = torch.Generator().manual_seed(7)
    prompt = [4, 6]
    counts = torch.zeros(SMALL_V, SMALL_V, SMALL_V)
    for _ in range(3000):
        t1, t2, t3 = first_tokens(proposer, verifier, prompt, 3, gen)
        counts[t1, t2, t3] += 1
    p = SYNTH.double()
    probs = target_probs(
        p, temperature, top_p
    )  # [a, b, V]: law of the next token after (..., a, b)
    # [t1, t2, t3]
    exact = probs[prompt[0], prompt[1]][:, None, None] * probs[prompt[1]][:, :, None] * probs
    assert float(counts[exact == 0].sum()) == 0  # nothing outside the top-p nucleus
    assert chi2_pvalue(counts.sum(2), exact.sum(2)) > ALPHA  # (t1, t2)
    assert chi2_pvalue(counts.sum(0), exact.sum(0)) > ALPHA  # (t2, t3)
