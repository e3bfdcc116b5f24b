"""Regeneration throughput by batch size: greedy first-turn replies of the same ShareGPT prompts
decoded at each ``--batch-size`` by
:func:`draftsmith.datagen.batched_generation.generate_greedy_batch` (what ``draftsmith regenerate``
runs), tokens/s for each, written as JSON and a markdown table.

    python docs/notebook/experiments/regen_batch_sweep.py --batches 1,8,16,32,64 --prompts 64 \\
        --max-new-tokens 128 --out DIR

Batch 1 decodes a quarter of the prompts (it is the slow reference). Time it alone: the figures are
wall-clock.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def first_turn_prompts(tokenizer, count: int, max_prompt_tokens: int = 512) -> list[list[int]]:
    """The first user turn of the first ``count`` embedded ShareGPT conversations (of at most that
    many tokens), chat-templated as ``regenerate`` sends them."""
    from draftsmith.datagen.chat_source import iter_conversations

    prompts = []
    for _, messages in iter_conversations("sharegpt"):
        user = next((m for m in messages if m["role"] == "user" and m["content"]), None)
        if user is None:
            continue
        ids = tokenizer.apply_chat_template(
            [user], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if len(ids) <= max_prompt_tokens:
            prompts.append(list(ids))
        if len(prompts) == count:
            break
    return prompts


def main() -> None:
    """Time each batch size on the same prompts; print and write the table."""
    from draftsmith.datagen.batched_generation import generate_greedy_batch
    from draftsmith.kernels import cpu_caps
    from draftsmith.runtime.serving import load_runtime

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batches", default="1,8,16,32,64")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--out", default="outputs/regen_batch_sweep")
    args = p.parse_args()
    runtime = load_runtime(None, None, args.dtype, "auto")
    prompts = first_turn_prompts(runtime.tokenizer, args.prompts)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        subset = prompts[: max(batch, len(prompts) // 4)] if batch == 1 else prompts
        start = time.perf_counter()
        with torch.inference_mode():
            outs = generate_greedy_batch(
                runtime.model,
                subset,
                [args.max_new_tokens] * len(subset),
                eos_ids=runtime.eos_ids,
                batch_size=batch,
            )
        seconds = time.perf_counter() - start
        tokens = sum(len(o) for o in outs)
        rows.append(
            {
                "batch_size": batch,
                "prompts": len(subset),
                "tokens": tokens,
                "seconds": round(seconds, 2),
                "tokens_per_s": round(tokens / seconds, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    record = {
        "cpu": cpu_caps.probe().describe(),
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "decoder": getattr(runtime, "decoder_backend", None),
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(record, indent=1))
    table = ["| batch | prompts | tokens | s | tokens/s |", "|---|---|---|---|---|"]
    table += [
        f"| {r['batch_size']} | {r['prompts']} | {r['tokens']} | {r['seconds']} |"
        f" {r['tokens_per_s']} |"
        for r in rows
    ]
    (out / "sweep.md").write_text(f"{record['cpu']}, {args.dtype}\n\n" + "\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
