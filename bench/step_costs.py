"""What one step costs on this machine, for ``bench.json``'s ``step_costs``: one plain decode step,
one verify forward of the export's tree and the forward curve over 1..16 new tokens (to size trees
for the machine), the AR step against its bandwidth floor, and the speedup tau predicts from them.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from draftsmith.bench import floors
from draftsmith.runtime.decoding.threads import governor
from draftsmith.runtime.serving import Runtime
from draftsmith.runtime.shapes import target_timing

# new tokens per forward: every verify size a candidate shape can have
FORWARD_SIZES = tuple(range(1, 17))


def loop_context(prompts: list[list[int]], max_new_tokens: int) -> int:
    """The decode loop's mean context: the mean prompt length + half the new tokens."""
    return round(sum(map(len, prompts)) / len(prompts) + max_new_tokens / 2)


def step_costs(
    runtime: Runtime, prompt: list[int], context: int | None = None, repeats: int = 5
) -> dict[str, Any]:
    """Median wall time of one plain decode step, of one verify forward of the export's tree, and of
    forwards of ``FORWARD_SIZES`` new tokens (to size trees for the machine), after ``context``
    tokens of cache (the prompt repeated; default its length). The decode loop runs at prompt + half
    the new tokens on average: attention grows with the context (a 5-token forward after 53 tokens
    took 0.95x one after ~134 in the loop, 2-core Zen 4).
    """
    model, spec = runtime.model, runtime.speculative
    nodes = spec.proposer.max_tree_nodes if spec else 1
    length = max(context or 0, len(prompt))
    prompt = (prompt * (length // len(prompt) + 1))[
        :length
    ]  # the prompt repeated up to ``context`` tokens
    cache = model.allocate_cache(len(prompt) + max(nodes, *FORWARD_SIZES) + 1)
    head = target_timing.loop_head(
        spec
    )  # the LM head the loops run (argmax for greedy verification)
    with torch.inference_mode():
        model.forward(torch.tensor(prompt), cache, logits_for="last")
        cache.commit(len(prompt))

        def one(tokens: int) -> float:
            ids = torch.full((tokens,), int(prompt[-1]))
            mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()
            # measured with the threads the loops would run with now (fewer while others are busy)
            governor().tick()
            start = time.perf_counter()
            model.forward(
                ids, cache, tree_mask=mask if tokens > 1 else None, logits_for="all", head=head
            )
            return time.perf_counter() - start

        one(1)
        ms = {
            t: 1e3 * statistics.median(one(t) for _ in range(repeats))
            for t in sorted({1, nodes, *FORWARD_SIZES})
        }
    weights = floors.decoder_step_bytes(model, len(prompt))[
        "total"
    ]  # weights + one embedding row + the prompt's KV
    bandwidth = floors.read_bandwidth_gbs(
        governor().max_threads
    )  # the probe --profile's floors use (cached)
    floor_ms = weights / (bandwidth * 1e9) * 1e3
    return {
        "tree_nodes": nodes,
        "lm_head": head,
        "ar_step_ms": ms[1],
        "verify_forward_ms": ms[nodes],
        "forward_ms_by_new_tokens": {t: ms[t] for t in FORWARD_SIZES},
        "weight_bytes_per_step": weights,
        "read_bandwidth_gbs": bandwidth,
        "bandwidth_floor_ms": floor_ms,
        "ar_step_over_floor": ms[1] / floor_ms,
    }


def step_cost_fields(
    costs: dict[str, Any], ar: dict[str, Any], sp: dict[str, Any], steps: int, tau: float
) -> dict[str, Any]:
    """bench.json ``step_costs``: the measured forward costs with the loops' own steps and the
    predicted speedup."""
    return {
        **costs,
        "ar_step_ms_in_decode": 1e3 * ar["seconds"] / max(1, ar["tokens"]),
        "spec_step_ms_in_decode": 1e3 * sp["seconds"] / max(1, steps),
        "predicted_speedup_tau_x_step_over_verify": (
            tau * costs["ar_step_ms"] / costs["verify_forward_ms"]
        ),
    }
