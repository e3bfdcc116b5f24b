"""A tiny target that has learned the synthetic chat data (tests/conftest.py's
``make_conversations``), so that a drafter trained on it has something to agree with when served:
the served-tau and trained-floor tests share it.

A random tiny Llama's greedy continuation is noise no drafter can predict; after a few seconds of
plain LM training on the data's repeating replies ("<w> is the answer to the question . ..."), its
greedy output follows that pattern and a few training steps give Medusa heads a tau well above 1 in
the runtime.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import build_tiny_llama, build_tiny_tokenizer, make_conversations


def chat_batch(tokenizer, conversations: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [N, T], attention_mask [N, T])`` of the chat-templated conversations,
    right-padded."""
    rows = []
    for conv in conversations:
        turns = [
            {"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
            for t in conv["conversations"]
        ]
        text = tokenizer.apply_chat_template(turns, tokenize=False)
        rows.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    length = max(map(len, rows))
    ids = torch.full((len(rows), length), int(tokenizer.pad_token_id))  # [N, T]
    mask = torch.zeros((len(rows), length), dtype=torch.long)  # [N, T]
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids, mask


def train_pattern_target(out: Path, steps: int = 80, seed: int = 0) -> Path:
    """Train a tiny Llama on ``make_conversations(64)`` (full-batch AdamW, ``steps`` steps) and save
    it with its tokenizer into ``out``: a target usable as ``target.name_or_path``."""
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_llama(len(tokenizer), seed=seed).train()
    ids, mask = chat_batch(tokenizer, make_conversations(64))
    labels = ids.masked_fill(mask == 0, -100)  # padding scores nothing
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_heldout_prompts(path: Path, count: int = 4, seed: int = 7) -> Path:
    """A ``bench --prompts`` jsonl of ``count`` user turns drawn with another seed than the training
    data's."""
    rows = [
        {"prompt": c["conversations"][0]["value"]} for c in make_conversations(count, seed=seed)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path
