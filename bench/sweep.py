"""Bench sweeps: plain AR, every fixed draft depth and the policy in force, timed interleaved on the
same prompts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from draftsmith.bench.timing import time_interleaved
from draftsmith.runtime.acceptance.stop_policies import FixedDepth
from draftsmith.runtime.decoding import metrics
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.speculative import SpecResult
from draftsmith.runtime.drafting.base import Proposer
from draftsmith.runtime.serving import Runtime


def sweep_fixed_depths(
    runtime: Runtime,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    depths: Sequence[int],
    proposer: Proposer | None = None,
) -> list[dict[str, Any]]:
    """Plain AR, every fixed depth K and the policy in force on the same prompts (same seeds), timed
    in one interleaved pass (:func:`time_interleaved`: prompt by prompt, rotating the order) so that
    the rows compare without the machine's drift between them: one row each with tau and tokens/s.
    ``proposer``: the drafter to sweep (default: the one in force; the bench passes the export's
    own, which the cost-aware default may have replaced by plain decoding)."""
    spec, saved, saved_proposer = (
        runtime.speculative,
        runtime.speculative.stop_policy,
        runtime.speculative.proposer,
    )
    sweep_proposer = proposer or saved_proposer
    policy_spec = ((runtime.inference or {}).get("stop_policy") or {}).get("spec", "export")
    configs = {f"fixed:{k}": (sweep_proposer, FixedDepth(int(k))) for k in depths}
    configs[f"{policy_spec} (in force)"] = (saved_proposer, saved)
    results: dict[str, list[SpecResult]] = {name: [] for name in configs}

    def decoder(name: str) -> Callable[[list[int]], list[int]]:
        def decode(prompt: list[int]) -> list[int]:
            spec.proposer, spec.stop_policy = configs[name]
            res = spec.generate(
                prompt,
                max_new_tokens,
                eos_ids=runtime.eos_ids,
                generator=torch.Generator().manual_seed(len(results[name])),
            )
            results[name].append(res)
            return res.tokens

        return decode

    decoders = {
        "plain (runtime AR)": lambda p: generate_ar(
            runtime.model, p, max_new_tokens, eos_ids=runtime.eos_ids
        )
    }
    decoders.update({name: decoder(name) for name in configs})
    try:
        timed = time_interleaved(decoders, prompts)
    finally:
        spec.stop_policy, spec.proposer = saved, saved_proposer
    rows = []
    for name, t in timed.items():
        pooled = [a for r in results.get(name, []) for a in r.accepted_per_step]
        rows.append(
            {
                "policy": name,
                "tau": metrics.tau(pooled) if pooled else 1.0,
                "tokens_per_s": t["tokens_per_s"],
            }
        )
    return rows


def fixed_depth_sweep(
    runtime: Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    sweep_k: list[int],
    export_proposer: Proposer,
) -> list[dict[str, Any]]:
    """Every fixed depth in ``sweep_k`` timed on ``prompts`` (:func:`sweep_fixed_depths`), each row
    with its speedup over the first row (plain AR)."""
    sweep = sweep_fixed_depths(runtime, prompts, max_new_tokens, sweep_k, export_proposer)
    for row in sweep:
        row["speedup_vs_runtime_ar"] = row["tokens_per_s"] / sweep[0]["tokens_per_s"]
    return sweep
