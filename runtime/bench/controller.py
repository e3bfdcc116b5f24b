"""``draftsmith bench --controller``: what an adaptive-temperature layer costs. The same decoding loop, prompts and
seeds run once with the layer choosing every position's temperature and once at a fixed temperature of 1."""

from __future__ import annotations

from typing import Any

import torch

from draftsmith.runtime.bench.tuning import timed_generations


def bench_controller(runtime: Any, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    """Tokens/s with and without the layer and its overhead; the mean temperature it chose."""
    spec = runtime.speculative
    layer = spec.temperature_policy
    chosen: list[torch.Tensor] = []

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        temps = layer(hidden)
        chosen.append(torch.as_tensor(temps).float().reshape(-1)[-1:])  # the position that emits next
        return temps

    spec.temperature_policy = recording
    with_layer, _ = timed_generations(spec, prompts, max_new_tokens, runtime.eos_ids)
    spec.temperature_policy = lambda hidden: torch.ones(hidden.shape[0])  # same loop, the layer's cost removed
    without, _ = timed_generations(spec, prompts, max_new_tokens, runtime.eos_ids)
    spec.temperature_policy = layer
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "controller": runtime.inference["controller"],
            "tokens_per_s_with_layer": with_layer["tokens_per_s"], "tokens_per_s_fixed_t1": without["tokens_per_s"],
            "overhead": 1.0 - with_layer["tokens_per_s"] / without["tokens_per_s"],
            "mean_chosen_temperature": float(torch.cat(chosen).mean()) if chosen else None}


def controller_table(result: dict[str, Any]) -> str:
    """The markdown the bench prints for a controller."""
    rows = [("controller", result["controller"]["export"]),
            ("granularity / grid", f"{result['controller']['granularity']} / {result['controller']['grid']}"),
            ("prompts x max new tokens", f"{result['prompts']} x {result['max_new_tokens']}"),
            ("tokens/s with the layer", f"{result['tokens_per_s_with_layer']:.1f}"),
            ("tokens/s at fixed T=1 (same loop)", f"{result['tokens_per_s_fixed_t1']:.1f}"),
            ("overhead of the layer", f"{100 * result['overhead']:.1f}%"),
            ("mean chosen temperature", "n/a" if result["mean_chosen_temperature"] is None
             else f"{result['mean_chosen_temperature']:.2f}")]
    return "| metric | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"
