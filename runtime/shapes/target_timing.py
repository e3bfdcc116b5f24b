"""What the target costs on this machine, as the decode loops run it: a verify forward of every
tree size 1..16 on a real KV cache (:func:`forward_curve`) and the plain decode step without its
prefill (:func:`decode_step_ms`), both with the LM head the loops run (:func:`loop_head`). Every
timer reads an injectable ``clock``; every step lets the thread governor tick, as the loops do."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.decoding.threads import governor
from draftsmith.runtime.shapes import draft_shapes
from draftsmith.runtime.shapes.shape_timing import Clock
from draftsmith.runtime.target.interface import TargetDecoder

VERIFY_SIZES = tuple(
    range(1, draft_shapes.MAX_NODES + 1)
)  # every forward size a candidate can verify


def loop_head(spec: SpeculativeDecoder | None) -> str:
    """The LM head the decode loops run: "argmax" where greedy verification (and so greedy plain
    decoding) reduces it to an argmax per row without [N, V] logits, else "logits". Costs are timed
    with this head: timed with the logits head, the embedded 135M target's plain step read 9.7 ms
    where the loop's timing implied about 8.4 ms, and every predicted speedup came out about 14%
    high (docs/notebook/MEASUREMENTS.md section 17)."""
    return "argmax" if spec is not None and spec.uses_argmax_head() else "logits"


def forward_curve(
    model: TargetDecoder,
    prompt: list[int],
    sizes: Sequence[int] = VERIFY_SIZES,
    repeats: int = 3,
    clock: Clock = time.perf_counter,
    head: str = "logits",
) -> dict[int, float]:
    """ms of one forward of ``n`` new tokens (a causal tree mask, as a verify step) after ``prompt``
    on a real KV cache, for every ``n`` in ``sizes`` (median of ``repeats``; the cache is not
    advanced), with the LM ``head`` the loop runs (:func:`loop_head`)."""
    device = model.device
    cache = model.allocate_cache(len(prompt) + max(sizes) + 1)
    with torch.inference_mode():
        model.forward(torch.tensor(prompt, device=device), cache, logits_for="last")
        cache.commit(len(prompt))

        def one(n: int) -> float:
            ids = torch.full((n,), int(prompt[-1]), device=device)
            mask = torch.ones(n, n, dtype=torch.bool, device=device).tril() if n > 1 else None
            # the threads the loops would run with now (a busy machine lends fewer)
            governor().tick()
            start = clock()
            model.forward(ids, cache, tree_mask=mask, logits_for="all", head=head)
            return 1e3 * (clock() - start)

        one(1)  # warm-up
        return {int(n): statistics.median(one(int(n)) for _ in range(repeats)) for n in sizes}


def decode_step_ms(
    model: TargetDecoder,
    prompts: Sequence[list[int]],
    tokens: int,
    clock: Clock = time.perf_counter,
    head: str = "logits",
) -> tuple[float, list[float]]:
    """The plain decode step WITHOUT the prefill: greedy steps after an untimed prefill of each
    prompt, with the LM ``head`` the loop runs (:func:`loop_head`). Returns (mean ms per step over
    every prompt, ms per step of each prompt)."""
    device = model.device
    per_prompt = []
    with torch.inference_mode():
        for prompt in prompts:
            cache = model.allocate_cache(len(prompt) + tokens + 1)
            logits = model.forward(
                torch.tensor(prompt, device=device), cache, logits_for="last"
            ).logits
            cache.commit(len(prompt))
            step = logits[-1].argmax().reshape(1)  # [1]
            spent = 0.0
            for _ in range(tokens):
                governor().tick()  # as the plain loop does
                start = clock()
                out = model.forward(step, cache, logits_for="last", head=head)
                cache.commit(1)
                spent += clock() - start
                step = (out.argmax if head == "argmax" else out.logits[-1].argmax()).reshape(1)
            per_prompt.append(1e3 * spent / tokens)
    return sum(per_prompt) / len(per_prompt), per_prompt
