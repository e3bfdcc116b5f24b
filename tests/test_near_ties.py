"""Where llama.cpp's speculative text parts from its plain one, and the near-tie judge
(evals/near_ties.py)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.evals.engine_check_report import equal_or_tied
from draftsmith.evals.near_ties import common_prefix, divergence, parting_tokens
from draftsmith.runtime.target.loading import load_decoder

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model(tiny_target_dir):
    return load_decoder(
        tiny_target_dir, dtype=torch.float32, backend="lean", kernel_backend="torch"
    )


def word_ids(tokenizer) -> list[int]:
    """The tokenizer's plain-word ids (no special tokens, no punctuation)."""
    return sorted(i for t, i in tokenizer.get_vocab().items() if t.isalpha())


def test_the_texts_part_at_the_first_differing_token(tiny_tokenizer):
    tok = tiny_tokenizer
    w = word_ids(tok)
    plain, spec = tok.decode(w[:3] + [w[5], w[6]]), tok.decode(w[:3] + [w[7]])
    assert common_prefix("abcx", "abcy") == 3 and common_prefix("ab", "abc") == 2
    assert parting_tokens(tok, plain, spec) == (w[:3], w[5], w[7])
    assert parting_tokens(tok, plain, plain) is None
    # one extends the other: they never part
    assert parting_tokens(tok, tok.decode(w[:3]), plain) is None


def test_the_judge_scores_both_tokens_with_the_target(model, tiny_tokenizer):
    tok = tiny_tokenizer
    w = word_ids(tok)
    prompt, common = w[10:14], w[:2]
    cache = model.allocate_cache(len(prompt) + len(common))
    logits = model.forward(torch.tensor(prompt + common), cache, logits_for="last").logits[
        -1
    ]  # [V]
    ranked = sorted(w, key=lambda i: -float(logits[i]))
    top, second, last = ranked[0], ranked[1], ranked[-1]
    plain, spec = tok.decode(common + [top, w[3]]), tok.decode(common + [second, w[4]])
    gap = float(logits[top] - logits[second])
    assert gap > 1e-4  # a random model's two best words are not exactly tied

    got = divergence(model, tok, prompt, plain, spec, tolerance=gap + 1e-4)
    assert (got["at"], got["plain_token"], got["speculative_token"]) == (
        2,
        tok.decode([top]),
        tok.decode([second]),
    )
    assert got["gap"] == pytest.approx(gap, abs=1e-4) and got["near_tie"]
    assert not divergence(model, tok, prompt, plain, spec, tolerance=gap - 1e-4)["near_tie"]
    # a token far below the best is no tie, whatever the gap between the two texts' tokens
    far = divergence(
        model,
        tok,
        prompt,
        tok.decode(common + [last]),
        tok.decode(common + [ranked[-2]]),
        tolerance=float(logits[ranked[-2]] - logits[last]) + 1e-4,
    )
    assert not far["near_tie"]
    assert divergence(model, tok, prompt, plain, plain) is None


def test_the_engine_check_row_says_which():
    equal = {"lossless": True, "lossless_per_prompt": [True, True]}
    tied = {
        "lossless": False,
        "lossless_per_prompt": [False, True],
        "near_ties_only": True,
        "divergences": [{"gap": 0.02, "near_tie": True}, None],
    }
    clear = {
        "lossless": False,
        "lossless_per_prompt": [False, True],
        "near_ties_only": False,
        "divergences": [{"gap": 3.1, "near_tie": False}, None],
    }
    assert equal_or_tied(equal) == "equal to plain"
    assert (
        equal_or_tied(tied)
        == "parts from plain on 1 prompts, each at a near-tie (logit gap <= 0.020)"
    )
    assert equal_or_tied(clear) == "DIFFERS: [False, True], logit gaps [3.1]"
