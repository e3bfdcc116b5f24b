"""Stage 1 of the peer harness (:mod:`peer_speculators`): our conversations and our target's hidden
states written in speculators' data format, in our venv with our Target.

``samples.jsonl`` (``input_ids``, ``loss_mask``: the assistant tokens, draftsmith's chat
tokenisation; the trainer's wrapper turns it into a ``datasets.save_to_disk`` folder inside the
speculators venv, as ours has no ``datasets``); ``token_freq.pt`` (token id -> count over the
loss-masked tokens, for ``--draft-vocab-size``); ``hidden_states/hs_{i}.safetensors`` with
``token_ids`` [T] (= ``input_ids``) and ``hidden_states`` [T, 4, H]: the target's
``hidden_states[l]`` at the three taps (the input of decoder layer l, draftsmith's and speculators'
aux-id convention) and the last layer's output BEFORE the final norm (speculators applies the
verifier's norm and LM head to it for the teacher distribution).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file


def tokenized_samples(tokenizer, conversations: list, tokens: int, max_length: int) -> list[dict]:
    """Conversations in order, tokenised with draftsmith's chat masking, until ``tokens`` tokens
    (samples with no assistant token are skipped)."""
    from draftsmith.distill.data.samples import tokenize_conversation

    samples, total = [], 0
    for messages in conversations:
        sample = tokenize_conversation(tokenizer, messages, max_length)
        if len(sample["input_ids"]) < 2 or not any(sample["loss_mask"]):
            continue
        samples.append(sample)
        total += len(sample["input_ids"])
        if total >= tokens:
            break
    return samples


@torch.no_grad()
def write_peer_data(
    target,
    samples: list[dict],
    taps: tuple[int, ...],
    data_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """Write ``samples`` with the target's hidden states in speculators' format (module docstring)
    into ``data_dir``; returns the sizes written."""
    from draftsmith.distill.target.frozen import FeatureTaps

    (data_dir / "hidden_states").mkdir(parents=True, exist_ok=True)
    want = FeatureTaps(final_hidden=False, prenorm_hidden=True, layers=tuple(taps))
    freq: Counter = Counter()
    for i, sample in enumerate(samples):
        ids = torch.tensor(sample["input_ids"], dtype=torch.long)  # [T]
        feats = target.features(ids[None], torch.ones_like(ids)[None], want)
        stack = [feats.layer_hidden[t][0] for t in taps] + [feats.prenorm_hidden[0]]  # 4 x [T, H]
        save_file(
            {
                "token_ids": ids,
                "hidden_states": torch.stack(stack, 1).to(dtype).contiguous(),
            },  # [T, 4, H]
            str(data_dir / "hidden_states" / f"hs_{i}.safetensors"),
        )
        freq.update(t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m)
    (data_dir / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    torch.save(dict(freq), data_dir / "token_freq.pt")
    return {
        "samples": len(samples),
        "tokens": sum(len(s["input_ids"]) for s in samples),
        "loss_tokens": sum(sum(s["loss_mask"]) for s in samples),
        "distinct_tokens": len(freq),
    }
