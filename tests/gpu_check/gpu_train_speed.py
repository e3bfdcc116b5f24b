"""``make gpu-train`` (a): training throughput at the real shapes, random weights, three batch sizes
in tokens: our EAGLE-3 online trainer (``bench-train``'s parts, compiled, packed rows) on synthetic
chats as long as real ones, and the table that sets it beside speculators 0.9.0's own trainer on
the same device (timed by :mod:`gpu_train_peer`). speculators trains from hidden states computed
beforehand, so its rate compares with our drafter-only (feature-cache) rate; our online rate adds
the target forward.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from gpu_check_core import WORDS


def synthetic_chats(count: int, min_words: int, max_words: int, seed: int = 0) -> list[dict]:
    """ShareGPT-style chats over the check's words with replies of ``min_words..max_words`` words
    (one token each with the word-level tokenizer): documents as long as real ones, so packing and
    attention cost what they would.
    """
    rng = random.Random(seed)
    words = sorted(set(WORDS))
    chats = []
    for _ in range(count):
        question = " ".join(rng.choice(words) for _ in range(rng.randint(8, 40))) + " ?"
        reply = " ".join(rng.choice(words) for _ in range(rng.randint(min_words, max_words))) + " ."
        chats.append(
            {
                "conversations": [
                    {"from": "human", "value": question},
                    {"from": "gpt", "value": reply},
                ]
            }
        )
    return chats


def our_rows(
    target: Path,
    data: Path,
    budgets: list[int],
    max_length: int,
    device: str,
    compile_step: bool,
    steps: int,
    warmup: int,
) -> list[dict[str, Any]]:
    """bench-train of EAGLE-3 at each tokens-per-step budget (host cost measured at the first
    only)."""
    from draftsmith.cli.training import compose_config
    from draftsmith.distill.engine.bench_train import bench_train
    from draftsmith.recipes import get_recipe

    rows = []
    for i, budget in enumerate(budgets):
        trainer = ["trainer=gpu"] if device == "cuda" else ["trainer=cpu"]
        cfg = compose_config(
            [
                "recipe=eagle3",
                f"target.name_or_path={target}",
                f"target.dtype={'bf16' if device == 'cuda' else 'fp32'}",
                f"data.spec={data}",
                "data.limit=null",
                f"data.max_length={max_length}",
                f"data.tokens_per_step={budget}",
                "data.val_fraction=0.01",
                *trainer,
                f"trainer.compile={str(compile_step).lower()}",
                *(
                    []
                    if device == "cuda"
                    else ["drafter.target_layers=[1,2,3]", "drafter.draft_vocab_size=256"]
                ),
            ]
        )
        result = bench_train(
            cfg, get_recipe("eagle3"), steps=steps, warmup=warmup, device=device, host=i == 0
        )
        rows.append({"budget": budget, **result})
    return rows


def speed_table(ours: list[dict], peer: list[dict]) -> str:
    """One markdown table: per budget, ours online / drafter-only / parts and utilization,
    speculators' rate."""
    by_budget = {row["budget"]: row for row in peer}
    lines = [
        (
            "| tokens/step | ours online tok/s | ours drafter-only tok/s | online vs parts | online"
            " utilization | host ms/step, compute negligible (2 layers / the depth) | speculators"
            " 0.9.0 tok/s (from hidden states) |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for row in ours:
        host = row.get("host") or []
        host_ms = " / ".join(f"{h['ms_per_step']:.1f}" for h in host) if host else ""
        peer_row = by_budget.get(row["budget"], {})
        peer_text = (
            f"{peer_row['tokens_per_s']:,.0f}"
            if "tokens_per_s" in peer_row
            else peer_row.get("error", "")
        )
        lines.append(
            f"| {row['budget']:,} | {row['train_tokens_per_s']:,.0f} | "
            f"{row['drafter_only_tokens_per_s']:,.0f} | {row['online_vs_parts']:.0%} | "
            f"{row['train_utilization']:.1%} | {host_ms} | {peer_text} |"
        )
    return "\n".join(lines)
