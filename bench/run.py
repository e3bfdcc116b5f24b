"""``draftsmith bench``: prove an export in the runtime: tau, acceptance curve, tokens/s, speedups,
lossless."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from draftsmith.bench import contention, progress, served, windows
from draftsmith.bench.quality import adapted_target_change, head_agreement
from draftsmith.bench.step_costs import loop_context, step_cost_fields, step_costs
from draftsmith.bench.step_profile import profile_steps
from draftsmith.bench.sweep import fixed_depth_sweep
from draftsmith.bench.timing import (
    compare_outputs,
    hf_baseline,
    speedup_ci,
    time_interleaved,
)
from draftsmith.runtime.decoding import metrics
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.speculative import SpecResult
from draftsmith.runtime.decoding.threads import governor
from draftsmith.runtime.drafting.base import Proposer, ReportsVerifyReuse
from draftsmith.runtime.serving import Runtime
from draftsmith.runtime.shapes import calibration


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
    phases, export_proposer = progress.current(), runtime.speculative.proposer
    m = _timed_phases(
        runtime, prompts, max_new_tokens, phases, skip_hf, hf_dtype, lossless, hf_result, cost_aware
    )
    acceptance = _pooled_acceptance(m.results, window, max_new_tokens)
    same_dtype = served.same_dtype_match(
        runtime, temperature, m.hf if m.hf_same_dtype else None, m.ar, m.sp
    )
    if m.lossless is None and check_lossless:
        m.lossless = _lossless_with_drafter(
            runtime, prompts, max_new_tokens, m, same_dtype, export_proposer
        )
    if profile:
        m.step_profile = phases.run(
            "profile (each part of a step)",
            lambda: profile_steps(runtime, prompts, max_new_tokens, export_proposer, m.cost_model),
        )
    if sweep_k:
        m.sweep = phases.run(
            "fixed-depth sweep (its own interleaved pass)",
            lambda: fixed_depth_sweep(runtime, prompts, max_new_tokens, sweep_k, export_proposer),
        )
    return _result(runtime, prompts, max_new_tokens, temperature, window, m, acceptance, same_dtype)


@dataclass
class _Measured:
    """What one bench measured, phase by phase: :func:`_timed_phases` times it, :func:`run_bench`
    adds the checks, :func:`_result` lays it out for bench.json."""

    hf: dict[str, Any] | None  # HF generate's timing (None with skip_hf)
    hf_torch_dtype: torch.dtype
    hf_reason: str  # why HF generate ran in that dtype
    hf_same_dtype: bool  # HF generate ran, in the runtime's dtype
    costs: dict[str, Any]  # the forward curve (:func:`step_costs`)
    cost_model: dict[str, Any] | None  # the cost-aware shape choice, when asked for
    ar: dict[str, Any]  # runtime AR's timing
    sp: dict[str, Any]  # speculative decoding's timing
    results: list[SpecResult]  # the speculative results of the timed pass
    busy: dict[str, Any]  # was the machine quiet while timing
    lossless: dict[str, Any] | None  # the lossless check (given, or run here)
    step_profile: dict[str, Any] | None = None
    sweep: list[dict[str, Any]] | None = None


def _timed_phases(
    runtime: Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    phases: progress.Progress,
    skip_hf: bool,
    hf_dtype: str,
    lossless: dict[str, Any] | None,
    hf_result: dict[str, Any] | None,
    cost_aware: bool,
) -> _Measured:
    """The timed phases of :func:`run_bench`: HF generate, the forward curve, the cost-aware shape
    (with ``cost_aware``), then runtime AR and speculative decoding interleaved; and whether the
    machine was quiet meanwhile."""
    timing_start = contention.snapshot()
    hf, hf_torch_dtype, hf_reason, lossless = phases.run(
        "HF generate baseline",
        lambda: hf_baseline(
            runtime, prompts, max_new_tokens, skip_hf, hf_dtype, lossless, hf_result
        ),
        len(prompts),
    )
    costs = phases.run(
        "forward curve (1-16 new tokens)",
        lambda: step_costs(runtime, prompts[0], loop_context(prompts, max_new_tokens)),
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
    same = hf is not None and hf_torch_dtype == runtime.model.dtype
    return _Measured(
        hf, hf_torch_dtype, hf_reason, same, costs, cost_model, ar, sp, results, busy, lossless
    )


def _lossless_with_drafter(
    runtime: Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    m: _Measured,
    same_dtype: dict[str, Any] | None,
    export_proposer: Proposer,
) -> dict[str, Any] | None:
    """The lossless check run here, in the timing dtype (:func:`served.with_drafter`): served plain
    decoding, the check still runs the drafter (the best measured shape, else the export's)."""
    return served.with_drafter(
        runtime,
        same_dtype,
        prompts,
        max_new_tokens,
        export_proposer,
        m.cost_model,
        (m.hf if m.hf_same_dtype else m.ar)["outputs"],
    )


def _result(
    runtime: Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    window: int,
    m: _Measured,
    acceptance: tuple[int, float, list[float], list[dict[str, Any]] | None],
    same_dtype: dict[str, Any] | None,
) -> dict[str, Any]:
    """bench.json: the run's settings, acceptance, tokens/s and speedups, the checks, step costs and
    the optional parts."""
    spec, (steps, tau, by_position, by_window) = runtime.speculative, acceptance
    hf, ar, sp = m.hf, m.ar, m.sp
    tps = {
        "hf_generate": hf["tokens_per_s"] if hf else None,
        "runtime_ar": ar["tokens_per_s"],
        "speculative": sp["tokens_per_s"],
    }
    return {
        **_run_settings(
            runtime, prompts, max_new_tokens, temperature, hf, m.hf_torch_dtype, m.hf_reason
        ),
        "tau": tau,
        "acceptance_by_position": by_position,
        "tau_by_window": by_window,
        "tau_window_tokens": window,
        "head_agreement_top1": head_agreement(runtime, prompts, ar["outputs"]),
        "tokens_per_s": tps,
        "speedup": _speedups(tps, ar, sp, hf),
        "lossless": None if m.lossless is None else m.lossless["all_identical"],
        "lossless_detail": m.lossless,
        "lossless_oracle": ((m.lossless or {}).get("oracle") or {}).get("all_identical"),
        "same_dtype_match": same_dtype,
        "runtime_ar_matches_hf": (
            compare_outputs(hf["outputs"], ar["outputs"])["all_identical"]
            if m.hf_same_dtype
            else None
        ),
        "step_costs": step_cost_fields(m.costs, ar, sp, steps, tau),
        "tokens": {
            "hf_generate": hf and hf["tokens"],
            "runtime_ar": ar["tokens"],
            "speculative": sp["tokens"],
        },
        "threads": torch.get_num_threads(),
        "cost_model": m.cost_model,
        "profile": m.step_profile,
        "sweep": m.sweep,
        "target_change": adapted_target_change(runtime, prompts, max_new_tokens, temperature, sp),
        # a verify model that reuses drafted states (verify forwards that skipped the shallow
        # layers)
        "verify_reuse": (
            spec.model.verify_reuse() if isinstance(spec.model, ReportsVerifyReuse) else None
        ),
        "served_plain": spec.serves_plain_ar(),
        "contention": m.busy,
        "served": served.served_text(runtime, m.cost_model),
        "phases": dict(progress.current().times),
    }


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
