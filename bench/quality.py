"""Quality numbers for exports that change their target (Medusa-2 is lossy): perplexity of the
served (adapted) target next to the original's on held-out conversations, and agreement with the
original's greedy tokens.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from draftsmith import assets
from draftsmith.common.chat import encode_chat
from draftsmith.runtime.serving import Runtime
from draftsmith.runtime.target.interface import TargetDecoder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
HELD_OUT = (
    8  # conversations from the END of the embedded ShareGPT file (training reads from its start)
)
MAX_TOKENS = 256


def held_out_sequences(
    tokenizer: PreTrainedTokenizerBase, count: int = HELD_OUT, max_tokens: int = MAX_TOKENS
) -> list[list[int]]:
    """Token ids of the last ``count`` usable conversations of the embedded ShareGPT data (chat
    template applied, cut to ``max_tokens``). Held out as long as training used fewer conversations
    than the file holds.
    """
    records, _ = assets.read_sharegpt(assets.sharegpt_path())
    out: list[list[int]] = []
    for record in reversed(records):
        messages = [
            {"role": ROLES.get(str(t.get("from", "")).lower()), "content": t.get("value")}
            for t in record["conversations"]
        ]
        if len(messages) < 2 or any(
            m["role"] is None or not isinstance(m["content"], str) for m in messages
        ):
            continue
        ids = encode_chat(tokenizer, messages, add_generation_prompt=False)[:max_tokens]
        if len(ids) > 8:
            out.append(ids)
        if len(out) >= count:
            break
    return out


@torch.inference_mode()
def perplexity(model: TargetDecoder, sequences: list[list[int]]) -> float:
    """exp(mean next-token NLL) of a runtime decoder over ``sequences`` (each token after the
    first)."""
    nll, count = 0.0, 0
    for seq in sequences:
        ids = torch.tensor(seq, device=model.device)
        logits = model.forward(
            ids, model.allocate_cache(len(seq)), logits_for="all"
        ).logits.float()  # [T, V]
        nll += float(torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum"))
        count += len(seq) - 1
    return math.exp(nll / max(1, count))


def lossy_target_report(
    runtime: Runtime,
    original: Runtime,
    spec_outputs: list[list[int]],
    original_outputs: list[list[int]] | None,
) -> dict[str, Any]:
    """For an export that changes its target: perplexity of the adapted and the original target on
    held-out conversations, and the share of greedy tokens (and whole outputs) equal to the original
    target's.
    """
    seqs = held_out_sequences(runtime.tokenizer)
    report: dict[str, Any] = {
        "lossy": True,
        "why": (
            "the export changes the target (its adapter is merged); "
            "outputs follow the adapted target, not the original"
        ),
        "held_out_conversations": len(seqs),
        "perplexity_adapted": perplexity(runtime.model, seqs),
        "perplexity_original": perplexity(original, seqs),
    }
    if original_outputs is not None:
        pairs = list(zip(spec_outputs, original_outputs))
        same = sum(a == b for a, b in pairs)
        tokens = sum(min(len(a), len(b)) for a, b in pairs)
        agree = sum(sum(x == y for x, y in zip(a, b)) for a, b in pairs)
        report.update(
            {
                "identical_outputs": f"{same}/{len(pairs)}",
                "greedy_token_agreement_with_original": agree / max(1, tokens),
            }
        )
    return report
