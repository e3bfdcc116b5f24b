"""What a bench really ran: the policy the timed speculative rows served, and the drafter shape the
lossless check ran.

The cost-aware default may serve plain decoding (speculation predicted, and measured, to lose on
this machine). Then the served outputs are the plain loop's and comparing them with HF ``generate``
says nothing about the export, so the lossless check runs the drafter anyway, on the best measured
draft shape of the calibration (else the export's own proposer and stop policy), against the same
reference; bench.json and the table say what was served and what was checked (``served``,
``lossless_detail.checked``, ``lossless_detail.tau``).
"""

from __future__ import annotations

from typing import Any

import torch

from draftsmith.bench import floors, progress
from draftsmith.bench.oracle import oracle_lossless
from draftsmith.bench.report_tables import cell
from draftsmith.bench.timing import compare_outputs, time_hf_generate
from draftsmith.runtime.decoding import metrics
from draftsmith.runtime.decoding.speculative import SpecResult
from draftsmith.runtime.drafting.base import Proposer
from draftsmith.runtime.serving import Runtime, load_runtime


def _counted(result: SpecResult) -> SpecResult:
    progress.step()
    return result


def served_text(runtime: Runtime, cost_model: dict[str, Any] | None) -> str:
    """What the timed speculative rows ran: plain decoding (and why), the cost-aware shape, or the
    given policy."""
    spec = runtime.speculative
    policy = (runtime.inference or {}).get("stop_policy") or {}
    given = f"{policy.get('spec', 'n/a')} ({policy.get('source', 'n/a')})"
    if spec.serves_plain_ar():
        why = (cost_model or {}).get("why") or f"the stop policy {given} drafts nothing"
        return f"plain decoding, no drafter ({why})"
    if cost_model:
        return (
            f"draft shape {cost_model.get('shape_label')} (cost-aware choice on this machine;"
            f" export policy {given})"
        )
    return f"stop policy {given}"


def checked_label(runtime: Runtime) -> str:
    """The label of a lossless check that ran the runtime's own proposer and stop policy (as
    loaded)."""
    policy = (runtime.inference or {}).get("stop_policy") or {}
    return (
        f"the drafter with stop policy {policy.get('spec', 'n/a')} ({policy.get('source', 'n/a')})"
    )


def drafted_tau(results: list[SpecResult]) -> float | None:
    """Tau over speculative results, None when nothing was drafted (plain decoding has no tau)."""
    if not any(d > 0 for r in results for d in r.depths):
        return None
    return metrics.tau([a for r in results for a in r.accepted_per_step])


def with_drafter(
    runtime: Runtime,
    same_dtype: dict[str, Any] | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    export_proposer: Proposer,
    cost_model: dict[str, Any] | None,
    reference: list[list[int]] | None,
) -> dict[str, Any] | None:
    """The same-dtype lossless record (:func:`same_dtype_match`), made to exercise the drafter: when
    plain decoding was served, greedy speculative decoding with the best measured draft shape (else
    the export's proposer) is run on ``prompts`` and compared with ``reference`` (the outputs
    ``same_dtype`` was compared with). Adds ``checked`` (what ran) and ``tau`` (the drafter's, on
    that run)."""
    spec = runtime.speculative
    if same_dtype is None or reference is None:
        return same_dtype
    if not spec.serves_plain_ar():
        return {
            **same_dtype,
            "checked": "the served policy (the timed speculative outputs)",
            "tau": None,
            "oracle": _oracle_if_fp32(runtime, prompts, max_new_tokens, reference),
        }
    saved = (spec.proposer, spec.stop_policy)
    try:
        label = floors.apply_profiled_shape(spec, export_proposer, cost_model)
        with (
            torch.inference_mode(),
            progress.current().phase("lossless check of the drafter", len(prompts)),
        ):
            results = [
                _counted(spec.generate(p, max_new_tokens, eos_ids=runtime.eos_ids)) for p in prompts
            ]
    finally:
        spec.proposer, spec.stop_policy = saved
    drafted = [r.tokens for r in results]
    return {
        **same_dtype,
        **compare_outputs(reference, drafted),
        "checked": label,
        "tau": drafted_tau(results),
        "oracle": _oracle_if_fp32(runtime, prompts, max_new_tokens, reference),
    }


def _oracle_if_fp32(
    runtime: Runtime, prompts: list[list[int]], max_new_tokens: int, reference: list[list[int]]
) -> dict[str, Any] | None:
    """The oracle beside the drafter (:func:`~draftsmith.bench.oracle.oracle_lossless`) where the
    check is exact: fp32 (a bf16 verify block may flip a near-tie, for any proposer)."""
    if runtime.model.dtype != torch.float32:
        return None
    with progress.current().phase(
        "lossless check: the oracle beside the drafter", 2 * len(prompts)
    ):
        return oracle_lossless(
            runtime.model,
            runtime.eos_ids,
            prompts,
            max_new_tokens,
            reference,
            runtime.speculative.kernel_backend,
        )


def lossless_check(
    drafter: str,
    target: str | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: str = "fp32",
    kernels: str = "auto",
    proposer_options: dict[str, Any] | None = None,
    backend: str = "auto",
    stop_policy: str | None = None,
) -> dict[str, Any]:
    """Greedy speculative output vs greedy HF ``generate`` of the target, token for token, in
    ``dtype`` (the decoder ``backend`` as the bench's own run: auto | lean | hf), with the export's
    stop policy or ``stop_policy`` (a ``--stop-policy`` given): it always runs the drafter, whatever
    the timed run serves (``checked`` says which).

    Exactness is checked in fp32: in bf16, verifying a block is not bit-identical to decoding token
    by token (different reduction orders), so near-ties can legitimately flip. The oracle proposer
    runs beside the drafter (``oracle``: :func:`~draftsmith.bench.oracle.oracle_lossless`), so
    accepted drafts are verified too.
    """
    phase = f"lossless check ({dtype}): load, HF generate, the drafter, the oracle"
    with progress.current().phase(phase, 4 * len(prompts)):
        runtime = load_runtime(
            drafter,
            target,
            dtype,
            kernels,
            "greedy",
            0.0,
            proposer_options=proposer_options,
            backend=backend,
            stop_policy=stop_policy,
        )
        hf = time_hf_generate(
            runtime.folder,
            prompts,
            max_new_tokens,
            dtype=runtime.model.dtype,
            trust_remote_code=runtime.trust_remote_code,
        )
        results = [
            _counted(runtime.speculative.generate(p, max_new_tokens, eos_ids=runtime.eos_ids))
            for p in prompts
        ]
        oracle = oracle_lossless(
            runtime.model, runtime.eos_ids, prompts, max_new_tokens, hf["outputs"], kernels
        )
    # "hf" lets run_bench reuse this timed HF run when HF's fastest dtype is the check's dtype (fp32
    # CPUs).
    return {
        "dtype": dtype,
        **compare_outputs(hf["outputs"], [r.tokens for r in results]),
        "hf": hf,
        "checked": checked_label(runtime),
        "tau": drafted_tau(results),
        "oracle": oracle,
    }


def same_dtype_match(
    runtime: Runtime,
    temperature: float,
    hf_reference: dict[str, Any] | None,
    ar: dict[str, Any],
    sp: dict[str, Any],
) -> dict[str, Any] | None:
    """Greedy lossless verifiers only: the speculative outputs against a same-dtype reference, HF
    when it ran in the runtime's dtype (``hf_reference``, else None), else the runtime's own AR
    (itself checked against HF).
    """
    if not (temperature == 0 and runtime.speculative.verifier.lossless):
        return None
    reference = hf_reference["outputs"] if hf_reference is not None else ar["outputs"]
    return {
        "dtype": str(runtime.model.dtype).replace("torch.", ""),
        "reference": "hf_generate" if hf_reference is not None else "runtime_ar",
        **compare_outputs(reference, sp["outputs"]),
    }


__all__ = [
    "checked_label",
    "drafted_tau",
    "lossless_check",
    "same_dtype_match",
    "served_text",
    "with_drafter",
]


def lossless_text(result: dict[str, Any]) -> str:
    """The lossless cell: the verdict, its counts and dtype, and what it ran (the drafter, whatever
    was served)."""
    detail = result.get("lossless_detail")
    if not detail:
        return "not checked (sampling or lossy verifier)"
    text = (
        f"{result['lossless']} ({detail['identical']}/{detail['total']} prompts identical,"
        f" {detail['dtype']})"
    )
    if detail.get("checked"):
        tau = detail.get("tau")
        text += f"; checked: {detail['checked']}" + (f", tau {tau:.3f}" if tau is not None else "")
    oracle = detail.get("oracle")
    if oracle:  # the oracle beside the drafter: accepted drafts verified on most steps
        text += (
            f"; oracle (acceptance {oracle['acceptance']:g}, chain {oracle['chain']}):"
            f" {oracle['all_identical']} ({oracle['identical']}/{oracle['total']}), tau"
            f" {cell(oracle['tau'], 3)}"
        )
    return text


def tau_text(result: dict[str, Any]) -> str:
    """Tau of the served policy; where plain decoding was served it has none, and the drafter's
    checked tau is shown."""
    if not result.get("served_plain"):
        return cell(result["tau"], 3)
    checked = (result.get("lossless_detail") or {}).get("tau")
    return "n/a: plain decoding was served (nothing drafted)" + (
        f"; the drafter's tau in the lossless check: {checked:.3f}" if checked is not None else ""
    )
