"""``draftsmith bench controller`` and ``bench reward``: what an adaptive-temperature layer costs
and, on a reward task, what it buys.

Cost: the same decoding loop, prompts and seeds run once with the layer choosing every position's
temperature and once replaying the temperatures it chose without running it. Reward (prompts
``embedded[:split]`` or a ``--reward``): see :mod:`draftsmith.evals.reward_eval`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from draftsmith.bench.timing import speedup_ci, time_interleaved
from draftsmith.runtime.serving import Runtime


def bench_controller(
    runtime: Runtime, prompts: list[list[int]], max_new_tokens: int
) -> dict[str, Any]:
    """Tokens/s with and without the layer and its overhead; the mean temperature it chose.

    An untimed first pass (also the warm-up) records the temperatures the layer picks, call by call.
    Then, per prompt and interleaved (drift shared), the loop runs once with the layer and once
    replaying those temperatures without it: same seeds, same temperatures, so the same tokens and
    sampling work; the difference is the layer.

    That difference is small against a prompt's timing noise on a busy CPU (a few percent), so the
    result also has a paired bootstrap interval over prompts (``overhead_ci95``; from a handful of
    prompts it is itself rough) and the layer's own cost measured directly: the summed time of its
    calls in the recording pass (the first prompt's calls, which pay the warm-up, left out and the
    rest scaled to all calls), as a share of the timed decode (``layer_share``). Summed, not a
    median: a sequence layer's one real head call per response counts.
    """
    spec = runtime.speculative
    layer = spec.temperature_policy
    index = {tuple(p): i for i, p in enumerate(prompts)}
    recorded: dict[int, list[torch.Tensor]] = {}
    call_seconds: list[list[float]] = []  # per prompt, per call

    def run(prompt: list[int], policy: Any) -> list[int]:
        spec.temperature_policy = policy
        generator = torch.Generator().manual_seed(index[tuple(prompt)])
        return spec.generate(
            prompt, max_new_tokens, eos_ids=runtime.eos_ids, generator=generator
        ).tokens

    def replay(prompt: list[int]) -> list[int]:
        calls = iter(recorded[index[tuple(prompt)]])

        def replaying(hidden: torch.Tensor) -> torch.Tensor:
            temps = next(calls, None)
            if temps is None or temps.numel() != hidden.reshape(-1, hidden.shape[-1]).shape[0]:
                raise RuntimeError(
                    "the replayed decode diverged from the recorded one; the layer's overhead"
                    " cannot be isolated"
                )
            return temps

        return run(prompt, replaying)

    try:
        for prompt in prompts:
            recorded[index[tuple(prompt)]] = store = []
            call_seconds.append([])
            run(prompt, _recording(layer, store, call_seconds[-1]))
        times = time_interleaved({"with": lambda p: run(p, layer), "without": replay}, prompts)
    finally:
        spec.temperature_policy = layer
    return _controller_result(runtime, prompts, max_new_tokens, recorded, call_seconds, times)


def _recording(layer: Any, store: list[torch.Tensor], seconds: list[float]) -> Any:
    """``layer`` wrapped to record each call: the temperatures it chose into ``store``, its seconds
    into ``seconds``."""

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        temps = layer(hidden)
        seconds.append(time.perf_counter() - t0)
        store.append(torch.as_tensor(temps).clone())
        return temps

    # a sequence-level layer decides afresh per prompt
    recording.reset = getattr(layer, "reset", lambda: None)
    return recording


def _controller_result(
    runtime: Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    recorded: dict[int, list[torch.Tensor]],
    call_seconds: list[list[float]],
    times: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The result of :func:`bench_controller` from its recorded temperatures, the layer's per-call
    seconds (per prompt) and the interleaved timings with and without the layer."""
    chosen = [
        t.float().reshape(-1)[-1] for calls in recorded.values() for t in calls
    ]  # the position emitting next
    with_layer, without = times["with"]["tokens_per_s"], times["without"]["tokens_per_s"]
    low, high = speedup_ci(
        times["without"], times["with"]
    )  # ratio with / without, paired by prompt
    calls = sum(len(c) for c in call_seconds)
    kept = [t for c in (call_seconds[1:] if len(call_seconds) > 1 else call_seconds) for t in c]
    layer_seconds = sum(kept) * calls / len(kept) if kept else None
    return {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "controller": runtime.inference["controller"],
        "tokens_per_s_with_layer": with_layer,
        "tokens_per_s_without_layer": without,
        "overhead": 1.0 - with_layer / without,
        "overhead_ci95": [None if high is None else 1.0 - high, None if low is None else 1.0 - low],
        "layer_ms_per_call": 1e3 * layer_seconds / calls if layer_seconds is not None else None,
        "layer_share": (
            layer_seconds / times["with"]["seconds"]
            if layer_seconds is not None and times["with"]["seconds"] > 0
            else None
        ),
        "layer_calls": calls,
        "mean_chosen_temperature": float(torch.stack(chosen).mean()) if chosen else None,
    }


def overhead_text(result: dict[str, Any]) -> str:
    """``"2.1% [-1.0%, 5.2%]; the layer itself 0.4% (0.021 ms x 374 calls)"``: the measured
    overhead, its interval, and the layer's directly timed share."""
    low, high = result.get("overhead_ci95") or (None, None)
    text = f"{100 * result['overhead']:.1f}%"
    if low is not None and high is not None:
        text += f" [{100 * low:.1f}%, {100 * high:.1f}%]"
    if result.get("layer_share") is not None:
        text += (
            f"; the layer itself {100 * result['layer_share']:.2f}%"
            f" ({result['layer_ms_per_call']:.3f} ms x {result['layer_calls']} calls)"
        )
    return text


def controller_table(result: dict[str, Any]) -> str:
    """The markdown the bench prints for a controller."""
    rows = [
        ("controller", result["controller"]["export"]),
        (
            "granularity / grid",
            f"{result['controller']['granularity']} / {result['controller']['grid']}",
        ),
        ("prompts x max new tokens", f"{result['prompts']} x {result['max_new_tokens']}"),
        ("tokens/s with the layer", f"{result['tokens_per_s_with_layer']:.1f}"),
        (
            "tokens/s replaying its temperatures (same loop)",
            f"{result['tokens_per_s_without_layer']:.1f}",
        ),
        ("overhead of the layer [95% CI]; its own timed share", overhead_text(result)),
        (
            "mean chosen temperature",
            (
                "n/a"
                if result["mean_chosen_temperature"] is None
                else f"{result['mean_chosen_temperature']:.2f}"
            ),
        ),
    ]
    return "| metric | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"
