"""Quality numbers beside the bench's speed: for exports that change their target (Medusa-2 is
lossy), perplexity of the served (adapted) target next to the original's on held-out conversations
and agreement with the original's greedy tokens; for lookahead heads (Medusa-style), each head's
top-1 agreement with the target's greedy tokens.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from draftsmith import assets
from draftsmith.bench.timing import time_runtime_ar
from draftsmith.common.chat import encode_chat
from draftsmith.runtime.drafting.base import LookaheadHeads
from draftsmith.runtime.serving import Runtime
from draftsmith.runtime.target.interface import TargetDecoder
from draftsmith.runtime.target.loading import load_decoder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
# conversations from the END of the embedded ShareGPT file (training reads from its start)
HELD_OUT = 8
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


def adapted_target_change(
    runtime: Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    sp: dict[str, Any],
) -> dict[str, Any] | None:
    """Medusa-2 (served on the adapted target): how the adapted target's outputs differ from the
    original's; None for an export that serves the target unchanged."""
    if not ((runtime.export_config or {}).get("target") or {}).get("adapter"):
        return None
    original = load_decoder(runtime.folder, dtype=runtime.model.dtype)
    original_outputs = time_runtime_ar(original, prompts, max_new_tokens, eos_ids=runtime.eos_ids)[
        "outputs"
    ]
    report = lossy_target_report(
        runtime, original, sp["outputs"], original_outputs if temperature == 0 else None
    )
    del original
    return report


def head_agreement(
    runtime: Runtime, prompts: list[list[int]], continuations: list[list[int]]
) -> list[float] | None:
    """Per-head top-1 agreement with the target's own greedy tokens on held-out prompts
    (Medusa-style heads).

    For each prompt, the target's greedy continuation is scored in one forward; head k at position t
    is right when its top-1 equals the continuation token at t+k+2. Only positions whose label lies
    in the continuation count. Returns one fraction per head, or None for proposers without heads.
    """
    proposer = runtime.speculative.proposer if runtime.speculative else None
    if not isinstance(proposer, LookaheadHeads):
        return None
    hits: list[int] = []
    total: list[int] = []
    with torch.inference_mode():
        for prompt, cont in zip(prompts, continuations):
            seq = list(prompt) + list(cont)
            if len(cont) < 3:
                continue
            cache = runtime.model.allocate_cache(len(seq))
            hidden = runtime.model.forward(
                torch.tensor(seq), cache, logits_for="last"
            ).hidden  # [T, H]
            top1 = proposer.lookahead_top1(hidden)  # [K, T] target ids
            labels = torch.tensor(seq)
            if not hits:
                hits, total = [0] * top1.shape[0], [0] * top1.shape[0]
            for k in range(top1.shape[0]):
                first = max(len(prompt) - k - 2, 0)  # label t+k+2 must be a generated token
                pred = top1[k, first : len(seq) - k - 2]
                hits[k] += int((pred == labels[first + k + 2 :]).sum())
                total[k] += pred.numel()
    return [h / t if t else 0.0 for h, t in zip(hits, total)]
