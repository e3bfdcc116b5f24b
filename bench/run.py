"""``draftsmith bench``: prove an export in the runtime: tau, acceptance curve, tokens/s, speedups,
lossless."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from draftsmith.bench import contention, floors, progress, quality, served, windows
from draftsmith.bench.sweep import sweep_fixed_depths
from draftsmith.bench.timing import (
    compare_outputs,
    speedup_ci,
    time_hf_generate,
    time_interleaved,
    time_runtime_ar,
)
from draftsmith.kernels import cpu_caps
from draftsmith.runtime.decoding import metrics
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.speculative import SpecResult
from draftsmith.runtime.decoding.threads import governor
from draftsmith.runtime.drafting.base import LookaheadHeads, Proposer, ReportsVerifyReuse
from draftsmith.runtime.serving import Runtime, hf_fastest_dtype
from draftsmith.runtime.shapes import calibration, loop_profile, target_timing
from draftsmith.runtime.target.loading import load_decoder

FORWARD_SIZES = tuple(
    range(1, 17)
)  # new tokens per forward: every verify size a candidate shape can have


def _loop_context(prompts: list[list[int]], max_new_tokens: int) -> int:
    """The decode loop's mean context: the mean prompt length + half the new tokens."""
    return round(sum(map(len, prompts)) / len(prompts) + max_new_tokens / 2)


def _step_costs(
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


def head_agreement(
    runtime: Runtime, prompts: list[list[int]], continuations: list[list[int]]
) -> list[float] | None:
    """Per-head top-1 agreement with the target's own greedy tokens on held-out prompts
    (Medusa-style heads).

    For each prompt, the target's greedy continuation is scored in one forward; head k at position t
    is right when its top-1 equals the continuation token at t+k+2. Only positions whose label lies
    in the continuation count. Returns one fraction per head, or None for proposers without heads.
    """
    proposer = runtime.speculative.proposer if runtime.speculative else None
    if not isinstance(proposer, LookaheadHeads):
        return None
    hits: list[int] = []
    total: list[int] = []
    with torch.inference_mode():
        for prompt, cont in zip(prompts, continuations):
            seq = list(prompt) + list(cont)
            if len(cont) < 3:
                continue
            cache = runtime.model.allocate_cache(len(seq))
            hidden = runtime.model.forward(
                torch.tensor(seq), cache, logits_for="last"
            ).hidden  # [T, H]
            top1 = proposer.lookahead_top1(hidden)  # [K, T] target ids
            labels = torch.tensor(seq)
            if not hits:
                hits, total = [0] * top1.shape[0], [0] * top1.shape[0]
            for k in range(top1.shape[0]):
                first = max(len(prompt) - k - 2, 0)  # label t+k+2 must be a generated token
                pred = top1[k, first : len(seq) - k - 2]
                hits[k] += int((pred == labels[first + k + 2 :]).sum())
                total[k] += pred.numel()
    return [h / t if t else 0.0 for h, t in zip(hits, total)]


def run_bench(
    runtime: Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    skip_hf: bool = False,
    temperature: float = 0.0,
    lossless: dict[str, Any] | None = None,
    hf_dtype: str = "same",
    hf_result: dict[str, Any] | None = None,
    cost_aware: bool = False,
    profile: bool = False,
    sweep_k: list[int] | None = None,
    check_lossless: bool = True,
    window: int = windows.DEFAULT_WINDOW,
) -> dict[str, Any]:
    """Time HF generate, runtime AR and speculative decoding on the same prompts.

    The runtime runs in its own dtype; HF ``generate`` in ``hf_dtype`` ("same": the runtime's;
    "auto": HF's fastest on this device, see :func:`hf_fastest_dtype`, which is what ``draftsmith
    bench`` uses so that "runtime AR vs HF" compares against a fair peer; or a dtype name).

    ``lossless``: :func:`lossless_check`'s result when run separately (fp32 while timing bf16; its
    HF run is reused when in HF's dtype, as is ``hf_result``); else greedy outputs are compared
    here, in the timing dtype (with the drafter even when plain decoding is served:
    :func:`draftsmith.bench.served.with_drafter`). ``cost_aware``: calibrate and apply this
    machine's fastest draft shape first (:mod:`draftsmith.runtime.shapes.calibration`).
    ``check_lossless=False``: no such check. ``profile``: time each part of a step; ``sweep_k``:
    also time fixed depths K; ``window``: tokens per window of ``tau_by_window``. Phases report
    progress (:mod:`.progress`).
    """
    spec, timing_start, phases = runtime.speculative, contention.snapshot(), progress.current()
    hf, hf_torch_dtype, hf_reason, lossless = phases.run(
        "HF generate baseline",
        lambda: _time_hf(runtime, prompts, max_new_tokens, skip_hf, hf_dtype, lossless, hf_result),
        len(prompts),
    )
    hf_same_dtype, export_proposer = (
        hf is not None and hf_torch_dtype == runtime.model.dtype,
        spec.proposer,
    )
    costs = phases.run(
        "forward curve (1-16 new tokens)",
        lambda: _step_costs(runtime, prompts[0], _loop_context(prompts, max_new_tokens)),
    )
    cost_model = (
        phases.run(
            "calibration (cost-aware draft shape)",
            lambda: _apply_cost_aware_depth(runtime, prompts, costs),
        )
        if cost_aware
        else None
    )
    ar, sp, results = phases.run(
        "timing: runtime AR vs speculative, interleaved",
        lambda: _time_ar_and_speculative(runtime, prompts, max_new_tokens),
        len(prompts),
    )
    # was the machine quiet while timing, and how often the decode loops gave up or took back a core
    busy = {
        **contention.verdict(timing_start, contention.snapshot()),
        "thread_changes": governor().changes,
    }
    steps, tau, by_position, by_window = _pooled_acceptance(results, window, max_new_tokens)
    same_dtype = served.same_dtype_match(
        runtime, temperature, hf if hf_same_dtype else None, ar, sp
    )
    # served plain decoding: the check still runs the drafter (the best measured shape, else the
    # export's)
    lossless = (
        lossless
        if lossless is not None or not check_lossless
        else served.with_drafter(
            runtime,
            same_dtype,
            prompts,
            max_new_tokens,
            export_proposer,
            cost_model,
            (hf if hf_same_dtype else ar)["outputs"],
        )
    )
    step_profile = (
        phases.run(
            "profile (each part of a step)",
            lambda: _profile(runtime, prompts, max_new_tokens, export_proposer, cost_model),
        )
        if profile
        else None
    )
    sweep = (
        phases.run(
            "fixed-depth sweep (its own interleaved pass)",
            lambda: _fixed_depth_sweep(runtime, prompts, max_new_tokens, sweep_k, export_proposer),
        )
        if sweep_k
        else None
    )
    tps = {
        "hf_generate": hf["tokens_per_s"] if hf else None,
        "runtime_ar": ar["tokens_per_s"],
        "speculative": sp["tokens_per_s"],
    }
    return {
        **_run_settings(
            runtime, prompts, max_new_tokens, temperature, hf, hf_torch_dtype, hf_reason
        ),
        "tau": tau,
        "acceptance_by_position": by_position,
        "tau_by_window": by_window,
        "tau_window_tokens": window,
        "head_agreement_top1": head_agreement(runtime, prompts, ar["outputs"]),
        "tokens_per_s": tps,
        "speedup": _speedups(tps, ar, sp, hf),
        "lossless": None if lossless is None else lossless["all_identical"],
        "lossless_detail": lossless,
        "lossless_oracle": ((lossless or {}).get("oracle") or {}).get("all_identical"),
        "same_dtype_match": same_dtype,
        "runtime_ar_matches_hf": (
            compare_outputs(hf["outputs"], ar["outputs"])["all_identical"]
            if hf_same_dtype
            else None
        ),
        "step_costs": _step_cost_fields(costs, ar, sp, steps, tau),
        "tokens": {
            "hf_generate": hf and hf["tokens"],
            "runtime_ar": ar["tokens"],
            "speculative": sp["tokens"],
        },
        "threads": torch.get_num_threads(),
        "cost_model": cost_model,
        "profile": step_profile,
        "sweep": sweep,
        "target_change": _adapted_target_change(runtime, prompts, max_new_tokens, temperature, sp),
        # a verify model that reuses drafted states (verify forwards that skipped the shallow
        # layers)
        "verify_reuse": (
            spec.model.verify_reuse() if isinstance(spec.model, ReportsVerifyReuse) else None
        ),
        "served_plain": spec.serves_plain_ar(),
        "contention": busy,
        "served": served.served_text(runtime, cost_model),
        "phases": dict(phases.times),
    }


def _step_cost_fields(
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


def _profile(
    runtime: Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    export_proposer: Proposer = None,
    cost_model: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``bench --profile``: the mean ms of each part of a speculative step, and each against its
    bandwidth floor (:mod:`draftsmith.bench.floors`): the AR step (decode only, without the
    prefill), the verify forward of the mean tree, drafting per call and per drafted token, with one
    verdict line per target. Where the served policy drafts nothing (the cost-aware choice served
    plain decoding), the best measured draft shape (else the export's own proposer) is profiled
    instead, so drafting is still measured against its floor.
    """
    spec = runtime.speculative
    saved, profiled = (spec.proposer, spec.stop_policy), "the served policy"
    try:
        if spec.serves_plain_ar() and export_proposer is not None:
            profiled = floors.apply_profiled_shape(spec, export_proposer, cost_model)
        drafting = spec.proposer
        with floors.counting_draft_calls(spec.proposer, runtime.model) as counted:
            report, results, _ = loop_profile.profiled_run(
                spec, prompts, max_new_tokens, runtime.eos_ids
            )
    finally:
        spec.proposer, spec.stop_policy = saved
    report["profiled"] = profiled
    steps = max(1, report["steps"])
    sizes = [n for r in results for n in r.tree_sizes]
    steps_info = {
        "context_tokens": statistics.mean(
            len(p) + len(r.tokens) / 2 for p, r in zip(prompts, results)
        ),
        "tree_nodes": statistics.mean(sizes) if sizes else 1.0,
        "draft_calls": counted["calls"] / steps if counted["calls"] else 1.0,
        "draft_calls_source": (
            "counted" if counted["calls"] else "assumed one per step (none counted)"
        ),
    }
    # the plain loop without its prefill, on the same prompts (the cost model's calibration prompts
    # may differ)
    ar_tokens = min(max_new_tokens, 32)
    ar_ms = target_timing.decode_step_ms(
        runtime.model, prompts, ar_tokens, head=target_timing.loop_head(runtime.speculative)
    )[0]
    steps_info["ar_context_tokens"] = statistics.mean(len(p) for p in prompts) + ar_tokens / 2
    # the threads the runtime decodes with on a quiet machine (the governor lends fewer while others
    # hold cores)
    threads = governor().max_threads
    found = floors.step_floors(
        runtime.model,
        drafting,
        report,
        steps_info,
        ar_ms,
        floors.read_bandwidth_gbs(threads),
        threads,
    )
    return {**report, "floors": found, "verdicts": floors.verdicts(found)}


def _time_hf(
    runtime: Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    skip_hf: bool,
    hf_dtype: str,
    lossless: dict[str, Any] | None,
    hf_result: dict[str, Any] | None,
) -> tuple[dict[str, Any] | None, torch.dtype, str, dict[str, Any] | None]:
    """HF ``generate`` timed in ``hf_dtype`` (see :func:`run_bench`): ``(timing or None with
    skip_hf, the dtype, why that dtype, lossless)``. A timed HF run carried by ``lossless`` (taken
    out of a copy of it, returned) or passed as ``hf_result`` is reused when it ran in that dtype on
    as many prompts."""
    if hf_dtype == "same":
        hf_torch_dtype, hf_reason = runtime.model.dtype, "same as the runtime"
    elif hf_dtype == "auto":
        hf_torch_dtype, hf_reason = hf_fastest_dtype(str(runtime.model.device))
    else:
        hf_torch_dtype, hf_reason = cpu_caps.resolve_dtype(hf_dtype, runtime.model.device)
    lossless = dict(lossless) if lossless is not None else None
    hf_result = hf_result or (lossless or {}).pop("hf", None)
    if skip_hf:
        hf = None
    elif (
        hf_result is not None
        and hf_result.get("dtype") == hf_torch_dtype
        and len(hf_result["outputs"]) == len(prompts)
    ):
        hf = hf_result
    else:
        hf = time_hf_generate(
            runtime.folder,
            prompts,
            max_new_tokens,
            dtype=hf_torch_dtype,
            trust_remote_code=runtime.trust_remote_code,
        )
    return hf, hf_torch_dtype, hf_reason, lossless


def _apply_cost_aware_depth(
    runtime: Runtime, prompts: list[list[int]], costs: dict[str, Any]
) -> dict[str, Any]:
    """Calibrate, predict and time candidate shapes, and apply the best measured one (or plain
    decoding) for this machine (:mod:`draftsmith.runtime.shapes.calibration`), reusing the forward
    curve measured for every size 1..16; its plain step is timed without the prefill there. Returns
    the cost model for bench.json.
    """
    verify_ms = {int(n): float(v) for n, v in costs["forward_ms_by_new_tokens"].items()}
    # a calibration measured while other processes were busy serves this bench but is not cached
    return contention.calibrated_if_quiet(
        runtime, lambda: calibration.choose_cost_aware_shape(runtime, prompts, verify_ms)[1]
    )


def _time_ar_and_speculative(
    runtime: Runtime, prompts: list[list[int]], max_new_tokens: int
) -> tuple[dict[str, Any], dict[str, Any], list[SpecResult]]:
    """Runtime AR and speculative decoding timed on ``prompts``, alternating prompt by prompt so the
    speedup is not the machine's drift: ``(AR timing, speculative timing, the speculative results of
    the timed pass)``. Speculative prompt i samples with a generator seeded by its call count."""
    spec = runtime.speculative
    results: list[SpecResult] = []

    def decode(prompt: list[int]) -> list[int]:
        gen = torch.Generator().manual_seed(len(results))
        result = spec.generate(prompt, max_new_tokens, eos_ids=runtime.eos_ids, generator=gen)
        results.append(result)
        return result.tokens

    timed = time_interleaved(
        {
            "runtime_ar": lambda p: generate_ar(
                runtime.model, p, max_new_tokens, eos_ids=runtime.eos_ids
            ),
            "speculative": decode,
        },
        prompts,
        {
            "runtime_ar": lambda: generate_ar(
                runtime.model, prompts[0], 4, eos_ids=runtime.eos_ids
            ),
            "speculative": lambda: spec.generate(prompts[0], 4, eos_ids=runtime.eos_ids),
        },
    )
    return timed["runtime_ar"], timed["speculative"], results[-len(prompts) :]


def _pooled_acceptance(
    results: list[SpecResult], window: int, max_new_tokens: int
) -> tuple[int, float, list[float], list[dict[str, Any]] | None]:
    """``(verify steps, tau, acceptance by draft position, tau by output window)`` pooled over the
    speculative results of every prompt; no windows when no step drafted anything (plain decoding
    served: no drafts, no tau).
    """
    steps = sum(r.steps for r in results)
    pooled_accepted = [a for r in results for a in r.accepted_per_step]
    tau = metrics.tau(pooled_accepted)
    depths = [d for r in results for d in r.depths]
    by_position = metrics.acceptance_by_position(pooled_accepted, depths)
    accepted = [r.accepted_per_step for r in results]
    by_window = (
        windows.tau_by_window(accepted, window, max_new_tokens)
        if any(d > 0 for d in depths)
        else None
    )
    return steps, tau, by_position, by_window


def _adapted_target_change(
    runtime: Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    sp: dict[str, Any],
) -> dict[str, Any] | None:
    """Medusa-2 (served on the adapted target): how the adapted target's outputs differ from the
    original's; None for an export that serves the target unchanged."""
    if not ((runtime.export_config or {}).get("target") or {}).get("adapter"):
        return None
    original = load_decoder(runtime.folder, dtype=runtime.model.dtype)
    original_outputs = time_runtime_ar(original, prompts, max_new_tokens, eos_ids=runtime.eos_ids)[
        "outputs"
    ]
    report = quality.lossy_target_report(
        runtime, original, sp["outputs"], original_outputs if temperature == 0 else None
    )
    del original
    return report


def _fixed_depth_sweep(
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


def _run_settings(
    runtime: Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    hf: dict[str, Any] | None,
    hf_torch_dtype: torch.dtype,
    hf_reason: str,
) -> dict[str, Any]:
    """The leading fields of a bench result: what was run, in which dtypes and on which backends."""
    spec = runtime.speculative
    return {
        "method": runtime.export_config["method"],
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "dtype": str(runtime.model.dtype).replace("torch.", ""),
        "temperature": temperature,
        "linear_backend": runtime.model.linear_ops,
        "backend": runtime.backend_report(),
        "hf_dtype": None if hf is None else str(hf_torch_dtype).replace("torch.", ""),
        "hf_dtype_reason": hf_reason,
        "verifier": type(spec.verifier).__name__,
        "inference": runtime.inference,
    }


def _speedups(
    tps: dict[str, float | None], ar: dict[str, Any], sp: dict[str, Any], hf: dict[str, Any] | None
) -> dict[str, Any]:
    """Speculative over HF generate and over runtime AR (with the paired 95% interval), and runtime
    AR over HF."""
    return {
        "vs_hf_generate": (tps["speculative"] / tps["hf_generate"]) if hf else None,
        "vs_runtime_ar": tps["speculative"] / tps["runtime_ar"],
        "vs_runtime_ar_ci95": list(speedup_ci(ar, sp)),
        "runtime_ar_vs_hf_generate": (tps["runtime_ar"] / tps["hf_generate"]) if hf else None,
    }
