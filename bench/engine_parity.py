"""Engine parity as a first-class number: tau in our runtime next to tau in the engine, on the same
prompts and the same drafted chain, for every export format an engine in reach runs (``draftsmith
bench --drafter EXPORT --engine-parity [CHAIN]``; the ``engine_parity`` section of bench.json and
rows of the bench's table).

Greedy decoding of the same target with the same drafter weights accepts the same drafts in any
engine, so the two taus differ only where the engines' numerics flip a near-tie. A gap of more than
:data:`GAP_LIMIT` (5%, relative to our tau) is therefore reported as a defect of the export (a
layer-index, norm or vocabulary mismatch in the converted files), never as noise; so is an engine
that cannot run an export its method claims a format for.

:data:`ROUTES` is the one table from a method to the engines in reach that run one of its formats.
Running an engine is not this room's business (``bench/`` never imports ``evals/``): the caller
passes one runner per engine (``cli/serving.py`` passes ``draftsmith engine-check``'s), which
returns both taus for a :class:`ParityRequest`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from draftsmith.bench import llamacpp_build
from draftsmith.export.gguf import GGUF_METHODS

# relative gap between the engine's tau and ours above which the export is called defective
GAP_LIMIT = 0.05
# a gap of exactly 5% in decimal is 0.05000000000000004 in binary floating point: still "ok"
_EPS = 1e-9


@dataclass(frozen=True)
class EngineRoute:
    """An engine in reach that runs an export of some method from one of its formats."""

    engine: str  # "llamacpp"
    format: str  # the ``draftsmith export --format`` the engine reads ("gguf")
    missing: Callable[
        [], str | None
    ]  # why the engine cannot run on this machine (None: it can), with the fix


@dataclass(frozen=True)
class ParityRequest:
    """What both engines run: the export, the bench's prompts, the drafted chain length, threads and
    our dtype."""

    export: str
    prompts: str  # mtbench | humaneval | FILE.jsonl, as the bench's --prompts
    num_prompts: int | None  # None: every prompt of the set (as the bench)
    max_new_tokens: int
    # tokens drafted per step, in both engines (None: the runner's default for the method)
    chain: int | None
    threads: int
    dtype: str = "auto"  # our runtime's


LLAMACPP = EngineRoute("llamacpp", "gguf", llamacpp_build.missing_build_reason)
# method -> the engines in reach that run one of its export formats: llama.cpp runs what its
# converter takes
ROUTES: dict[str, tuple[EngineRoute, ...]] = {method: (LLAMACPP,) for method in GGUF_METHODS}
# engine -> runner: (route, request) -> {"tau_ours", "tau_engine", optionally "chain" (the one run),
# any detail}
Runner = Callable[[EngineRoute, ParityRequest], dict[str, Any]]


def relative_gap(tau_ours: float | None, tau_engine: float | None) -> float | None:
    """``(tau_engine - tau_ours) / tau_ours``; None when either tau is missing or ours is not
    positive."""
    if tau_ours is None or tau_engine is None or tau_ours <= 0:
        return None
    return (tau_engine - tau_ours) / tau_ours


def verdict(engine: str, tau_ours: float | None, tau_engine: float | None) -> str:
    """``"ok"`` when the engine's tau is within 5% of ours (inclusive), else ``"DEFECT: ..."``
    saying why."""
    gap = relative_gap(tau_ours, tau_engine)
    if gap is None:
        return (
            f"DEFECT: no tau to compare (ours {tau_ours}, {engine} {tau_engine}): the export did"
            " not run as speculative decoding in both engines"
        )
    if abs(gap) <= GAP_LIMIT + _EPS:
        return "ok"
    side = "below" if gap < 0 else "above"
    return (
        f"DEFECT: {engine} tau {tau_engine:.3f} is {abs(gap):.1%} {side} ours {tau_ours:.3f} (> "
        f"{GAP_LIMIT:.0%}): a defect of the export, not noise"
    )


def engine_parity(
    method: str,
    request: ParityRequest,
    runners: dict[str, Runner],
    routes: dict[str, tuple[EngineRoute, ...]] | None = None,
) -> list[dict[str, Any]]:
    """The ``engine_parity`` section: one row per engine in reach for ``method``: ``{engine, format,
    chain, prompts, tau_ours, tau_engine, gap, verdict}`` (and the runner's ``detail``), or
    ``{engine, format, skipped}`` with the reason (no engine in reach runs the method, the engine is
    not built here, no runner for it)."""
    routes = ROUTES if routes is None else routes
    if method not in routes:
        covered = ", ".join(sorted(routes)) or "nothing"
        reason = f"no engine in reach runs a {method!r} export (engine parity covers: {covered})"
        return [{"engine": None, "format": None, "skipped": reason}]
    rows = []
    for route in routes[method]:
        row: dict[str, Any] = {
            "engine": route.engine,
            "format": route.format,
            "chain": request.chain,
            "prompts": f"{request.num_prompts or 'all'} {request.prompts}",
            "max_new_tokens": request.max_new_tokens,
        }
        reason = route.missing() or (
            None if route.engine in runners else f"no runner for {route.engine} given"
        )
        if reason:
            rows.append({**row, "skipped": reason})
            continue
        try:
            detail = dict(runners[route.engine](route, request))
            ours, theirs = detail.pop("tau_ours"), detail.pop("tau_engine")
            row["chain"] = detail.pop("chain", row["chain"])
            text = verdict(route.engine, ours, theirs)
        # an engine that cannot run the export is the finding, not a crash
        except Exception as err:  # noqa: BLE001
            ours = theirs = None
            detail = {"error": f"{type(err).__name__}: {err}"[:600]}
            text = (
                f"DEFECT: {route.engine} could not run the {route.format} export"
                f" ({detail['error']})"
            )
        rows.append(
            {
                **row,
                "tau_ours": ours,
                "tau_engine": theirs,
                "gap": relative_gap(ours, theirs),
                "verdict": text,
                "detail": detail,
            }
        )
    return rows


def markdown_rows(section: list[dict[str, Any]] | None) -> list[tuple[str, str]]:
    """Rows of the bench's table: tau ours / tau in the engine, the gap and the verdict (or the skip
    reason)."""
    rows = []
    for r in section or []:
        label = f"engine parity: {r['engine'] or 'no engine'}" + (
            f" ({r['format']}, chain {r['chain'] or 'default'})" if r["engine"] else ""
        )
        if "skipped" in r:
            rows.append((label, f"skipped: {r['skipped']}"))
            continue
        gap = "n/a" if r["gap"] is None else f"{r['gap']:+.1%}"
        tau = " / ".join(
            "n/a" if t is None else f"{t:.3f}" for t in (r["tau_ours"], r["tau_engine"])
        )
        detail = r.get("detail") or {}
        lossless = detail.get("engine_lossless")
        same = (
            ""
            if lossless is None
            else f"; engine's speculative text = its plain greedy text: {lossless}"
        )
        if lossless is False and detail.get("engine_near_ties_only"):
            same += (
                " (parted only at near-ties: the engine's batched verify rounds unlike its decode)"
            )
        rows.append(
            (
                label,
                (
                    f"tau ours / engine {tau} on {r['prompts']} prompts x {r['max_new_tokens']},"
                    f" gap {gap}: {r['verdict']}{same}"
                ),
            )
        )
    return rows
