"""Where two greedy texts of the same prompt part, and whether the target was near a tie there.

llama.cpp's speculative decoding verifies several tokens in one batched forward, whose kernels round
unlike its one-token decode: on CPUs without bf16 dot products (AVX2, e.g. AMD Zen 3) its bf16
target then picks the other of two near-tied tokens now and then, and the texts part (llama.cpp
issues #25618, #27407). That is the engine's numerics, not a wrong draft: a draft token only ever
reaches the text through the target's own verification. A divergence at a clear margin, though,
would mean the engine emitted a token its target did not pick.

:func:`divergence` finds the first token where a speculative text leaves the plain one and scores
both tokens with the target in fp32 on the common context: ``gap`` is how far the lower of the two
sits below the higher, in logits. A gap within :data:`NEAR_TIE_LOGITS` is a near-tie.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

# Logit gap still called a tie. Measured: llama.cpp 0.3.36's EAGLE-3 runs on the embedded SmolLM2
# (bf16 GGUF, 8 MT-Bench prompts, 2-core Zen 3) parted from its plain text on 6 prompts at gaps of
# 0.003-0.050 (fp32 judge); a token emitted 0.25 below the other is no rounding difference.
NEAR_TIE_LOGITS = 0.25


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    return len(os.path.commonprefix([a, b]))


def parting_tokens(
    tokenizer: Any, plain: str, speculative: str
) -> tuple[list[int], int, int] | None:
    """``(common ids, plain's token, speculative's token)`` at the first token where the texts part,
    tokenised by ``tokenizer`` (None when one text extends the other: they never part)."""
    cut = common_prefix(plain, speculative)
    if cut in (len(plain), len(speculative)):
        return None
    plain_ids = tokenizer.encode(plain, add_special_tokens=False)
    # the first plain token that reaches past the common text; the ids before it decode inside the
    # common text
    k = next(
        i for i in range(len(plain_ids) + 1) if len(tokenizer.decode(plain_ids[: i + 1])) > cut
    )
    common = plain_ids[:k]
    rest = speculative[len(tokenizer.decode(common)) :]
    spec_ids = tokenizer.encode(rest, add_special_tokens=False)
    if not spec_ids or spec_ids[0] == plain_ids[k]:
        # the texts part inside one token's text but tokenise alike from here: not a token choice
        return None
    return common, plain_ids[k], spec_ids[0]


@torch.inference_mode()
def divergence(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    plain: str,
    speculative: str,
    tolerance: float = NEAR_TIE_LOGITS,
) -> dict[str, Any] | None:
    """The first token where ``speculative`` leaves ``plain`` (both generated from ``prompt_ids``)
    scored by
    ``model`` (a runtime decoder, fp32 for a fair judge): ``{"at", "plain_token",
    "speculative_token", "plain_logit", "speculative_logit", "top_logit", "gap", "near_tie"}``, or
    None where the texts do not part.
    """
    parted = parting_tokens(tokenizer, plain, speculative)
    if parted is None:
        return None
    common, mine, theirs = parted
    ids = [*prompt_ids, *common]
    cache = model.allocate_cache(len(ids))
    logits = (
        model.forward(
            torch.tensor(ids, dtype=torch.long, device=model.device), cache, logits_for="last"
        )
        .logits[-1]
        .float()
    )  # [V]
    a, b, top = float(logits[mine]), float(logits[theirs]), float(logits.max())
    gap = abs(a - b)
    return {
        "at": len(common),
        "plain_token": tokenizer.decode([mine]),
        "speculative_token": tokenizer.decode([theirs]),
        "plain_logit": round(a, 4),
        "speculative_logit": round(b, 4),
        "top_logit": round(top, 4),
        "gap": round(gap, 4),
        "near_tie": gap <= tolerance and max(a, b) >= top - tolerance,
    }
