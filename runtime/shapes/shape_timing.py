"""Timing candidate shapes against plain decoding in the real loop (the check of the cost model's
prediction): every candidate and two identical plain passes run prompt by prompt in a rotated order,
so the machine's drift is shared; the two plain passes give the noise. Besides the speedup (prefill
included, what a user sees), each shape's decode step is measured without its prefill, which the
cost model refits its overhead on. Every timer reads ``clock``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from draftsmith.runtime.acceptance.stop_policies import StopPolicy
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import Proposer
from draftsmith.runtime.shapes import draft_shapes
from draftsmith.runtime.target.interface import TargetDecoder

CHECK_TOKENS = 32  # new tokens per prompt when timing a shape
MIN_NOISE = 0.03  # the noise floor when two identical plain passes happened to agree closely
Clock = Callable[[], float]


@dataclass
class ShapeTimings:
    """What timing some shapes against plain decoding measured."""

    speedup: dict[
        str, float
    ]  # label -> tokens/s over plain decoding's (prefill included, both sides)
    # largest per-prompt disagreement of the two identical plain passes (at least MIN_NOISE)
    noise: float
    step_ms: dict[str, float] = field(
        default_factory=dict
    )  # label -> ms per verified step, prefill excluded
    tokens_per_step: dict[str, float] = field(
        default_factory=dict
    )  # label -> emitted tokens per verified step
    decode_speedup: dict[str, float] = field(
        default_factory=dict
    )  # label -> speedup with prefills taken out

    def merge(self, other: ShapeTimings) -> ShapeTimings:
        """Both rounds' shapes; the larger noise."""
        return ShapeTimings(
            {**self.speedup, **other.speedup},
            max(self.noise, other.noise),
            {**self.step_ms, **other.step_ms},
            {**self.tokens_per_step, **other.tokens_per_step},
            {**self.decode_speedup, **other.decode_speedup},
        )


def interleaved(
    decoders: dict[str, Callable[[list[int]], int]],
    prompts: Sequence[list[int]],
    clock: Clock = time.perf_counter,
) -> dict[str, list[tuple[int, float]]]:
    """(tokens, seconds) of every decoder on every prompt, prompt i running them in an order rotated
    by i so that the machine's drift is shared (the runtime's own copy of the bench's interleaved
    timer; runtime/ never imports bench/). Each decoder returns how many tokens it emitted."""
    names = list(decoders)
    out: dict[str, list[tuple[int, float]]] = {n: [] for n in names}
    for i, prompt in enumerate(prompts):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            start = clock()
            emitted = decoders[name](list(prompt))
            out[name].append((emitted, clock() - start))
    return out


def rate(rows: list[tuple[int, float]], less_seconds: float = 0.0) -> float:
    """Tokens per second over (tokens, seconds) rows, with ``less_seconds`` (e.g. the prefills)
    taken out."""
    return sum(t for t, _ in rows) / max(sum(s for _, s in rows) - less_seconds, 1e-12)


def prefill_seconds(
    model: TargetDecoder, prompts: Sequence[list[int]], clock: Clock = time.perf_counter
) -> list[float]:
    """Seconds of one prefill forward of each prompt (the faster of two), to take out of a timed
    generation."""
    device = model.device
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            spent = []
            for _ in range(2):
                cache = model.allocate_cache(len(prompt) + 1)
                start = clock()
                model.forward(torch.tensor(prompt, device=device), cache, logits_for="last")
                spent.append(clock() - start)
            out.append(min(spent))
    return out


def check_shapes(
    spec: SpeculativeDecoder,
    base: Proposer,
    candidates: Sequence[draft_shapes.Shape],
    prompts: Sequence[list[int]],
    eos_ids: Sequence[int],
    clock: Clock = time.perf_counter,
) -> ShapeTimings:
    """Time each candidate (a few real steps: ``CHECK_TOKENS`` per prompt) interleaved with two
    identical plain passes. The noise is the largest per-prompt disagreement of the two plain passes
    (at least ``MIN_NOISE``); a shape's decode step is its time less each prompt's prefill
    (:func:`prefill_seconds`: the target's forward only, so the drafter's first pass over the prompt
    stays in the steps) over its verified steps."""
    saved = spec.proposer, spec.stop_policy
    runs: dict[str, tuple[Proposer, StopPolicy | None]] = {}
    for shape in candidates:
        draft_shapes.apply_shape(spec, shape, base)
        runs[shape.label] = (spec.proposer, spec.stop_policy)
        spec.proposer, spec.stop_policy = saved
    steps: dict[str, list[int]] = {label: [] for label in runs}
    decoders = _decoders(spec, runs, steps, eos_ids)
    try:
        for run in decoders.values():  # warm-up, untimed
            run(list(prompts[0])[:])
        for counted in steps.values():
            counted.clear()
        timed = interleaved(decoders, prompts, clock)
    finally:
        spec.proposer, spec.stop_policy = saved
    return _timings(timed, steps, prefill_seconds(spec.model, prompts, clock), len(prompts))


def _decoders(
    spec: SpeculativeDecoder,
    runs: dict[str, tuple[Proposer, StopPolicy | None]],
    steps: dict[str, list[int]],
    eos_ids: Sequence[int],
) -> dict[str, Callable[[list[int]], int]]:
    """``prompt -> new tokens`` for two identical plain passes and every shape in ``runs`` (its
    proposer and stop policy set on ``spec`` for the run; its verified steps counted in
    ``steps``)."""

    def spec_run(label: str) -> Callable[[list[int]], int]:
        def run(prompt: list[int]) -> int:
            spec.proposer, spec.stop_policy = runs[label]
            result = spec.generate(
                prompt, CHECK_TOKENS, eos_ids=eos_ids, generator=torch.Generator().manual_seed(0)
            )
            steps[label].append(result.steps)
            return len(result.tokens)

        return run

    def plain(prompt: list[int]) -> int:
        return len(generate_ar(spec.model, prompt, CHECK_TOKENS, eos_ids=eos_ids))

    return {
        "plain": plain,
        "plain (again)": plain,
        **{label: spec_run(label) for label in runs},
    }


def _timings(
    timed: dict[str, list[tuple[int, float]]],
    steps: dict[str, list[int]],
    prefill: list[float],
    num_prompts: int,
) -> ShapeTimings:
    """Speedups, noise, decode steps and tokens per step from the interleaved runs (``timed``: per
    decoder, (new tokens, seconds) of each prompt; ``prefill``: each prompt's prefill seconds)."""
    runs = [label for label in timed if label not in ("plain", "plain (again)")]
    ar = rate(timed["plain"] + timed["plain (again)"])
    pairs = zip(timed["plain"], timed["plain (again)"])
    noise = max([MIN_NOISE] + [abs(rate([a]) / max(rate([b]), 1e-12) - 1.0) for a, b in pairs])
    step_ms = {
        label: (
            1e3
            * max(0.0, sum(s for _, s in timed[label]) - sum(prefill))
            / max(1, sum(steps[label]))
        )
        for label in runs
    }
    # the prefill emits each prompt's first token; the verified steps emit the rest
    tokens = {
        label: (sum(t for t, _ in timed[label]) - num_prompts) / max(1, sum(steps[label]))
        for label in runs
    }
    plain_rate = rate(
        timed["plain"] + timed["plain (again)"], 2 * sum(prefill)
    )  # prefills out of both passes
    decode = {label: rate(timed[label], sum(prefill)) / plain_rate for label in runs}
    return ShapeTimings(
        {label: rate(timed[label]) / ar for label in runs}, noise, step_ms, tokens, decode
    )
