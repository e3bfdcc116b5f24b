"""Bandwidth floors (``draftsmith bench export --profile``): the least time a plain decoding step, a
verify forward and a draft call can take on this machine, next to what they took.

At batch 1 on a CPU every step streams its weights from memory once, so ``bytes read / read
bandwidth`` bounds it from below. The byte counts come from the loaded modules (numel x element size
of every floating tensor the forward reads), the bandwidth from :func:`read_bandwidth_gbs`, measured
with the threads the runtime decodes with. Targets (issue 25): one AR step at most 1.3x its floor, a
drafted token at most 2x its drafter's floor.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from draftsmith.kernels import cpu_caps
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import Proposer
from draftsmith.runtime.target.interface import TargetDecoder

AR_TARGET = 1.3  # one AR step at most this many times its floor (issue 25, item 5)
# one drafted token at most this many times its drafter's floor (issue 25, item 4)
DRAFT_TARGET = 2.0
PROBE_MIB = 256  # 8x the 32 MiB L3 of the bench CPU: the sums stream from DRAM, not from a cache
_CACHE: dict[tuple[int, int], float] = {}  # (threads, MiB) -> GB/s: measured once per bench run


def _reduce_once(buf: torch.Tensor) -> float:
    """Seconds one full reduction of ``buf`` takes (reads every byte once)."""
    start = time.perf_counter()
    buf.sum()
    return time.perf_counter() - start


def read_bandwidth_gbs(
    threads: int | None = None, mib: int = PROBE_MIB, repeats: int = 5, fresh: bool = False
) -> float:
    """Memory read bandwidth (GB/s) with ``threads`` torch threads (default: the current count,
    which the runtime decodes with), cached per (threads, MiB) unless ``fresh``.

    A sum reads each byte once and does one add per element, so it runs at the memory's speed. Best
    of ``repeats``: a preempted repetition is slower, never faster. The probe sums a bf16 buffer
    (the serving dtype) and an fp32 one of the same size and keeps the faster: on a CPU without
    native bf16 the bf16 sum is limited by conversions, and a floor must not be raised by a slow
    probe."""
    threads = threads or torch.get_num_threads()
    if threads < 1 or mib < 1 or repeats < 1:
        raise ValueError(f"need threads, mib and repeats >= 1, got {threads}, {mib}, {repeats}")
    key = (threads, mib)
    if not fresh and key in _CACHE:
        return _CACHE[key]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = 0.0
        for dtype in (torch.bfloat16, torch.float32):
            buf = torch.ones(
                mib * 2**20 // torch.tensor([], dtype=dtype).element_size(), dtype=dtype
            )  # [mib MiB]
            _reduce_once(buf)  # first touch: pages are mapped here, not timed
            seconds = min(_reduce_once(buf) for _ in range(repeats))
            best = max(best, buf.numel() * buf.element_size() / max(seconds, 1e-9) / 1e9)
            del buf
    finally:
        torch.set_num_threads(before)
    _CACHE[key] = best
    return best


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _floating(module: nn.Module) -> dict[int, tuple[list[str], torch.Tensor]]:
    """Every floating tensor (parameters and buffers) of ``module``, once per data pointer: {ptr:
    (names, tensor)}. Integer tensors (draft-vocabulary maps) are gathered from, not streamed, so
    they are left out.
    """
    out: dict[int, tuple[list[str], torch.Tensor]] = {}
    named = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    for name, t in named:
        if t is None or not t.is_floating_point() or t.numel() == 0:
            continue
        names, kept = out.get(t.data_ptr(), ([], t))
        out[t.data_ptr()] = ([*names, name], kept if _nbytes(kept) >= _nbytes(t) else t)
    return out


def decoder_step_bytes(
    model: TargetDecoder, context_tokens: float, new_tokens: int = 1
) -> dict[str, int]:
    """Bytes one forward of ``new_tokens`` tokens after ``context_tokens`` cached ones must read:
    every decoder layer's weights, the final norm, the LM head (once; a tied head is the embedding),
    one embedding row per new token and the keys and values of the context, all in the serving
    dtype."""
    embed, head = model.embed_weight, model.lm_head_weight
    tensors = _floating(model)
    skip = {embed.data_ptr(), head.data_ptr()}
    rest = sum(_nbytes(t) for ptr, (_, t) in tensors.items() if ptr not in skip)
    layers_module = model.decoder_layers
    layers = (
        sum(_nbytes(t) for _, t in _floating(layers_module).values())
        if layers_module is not None
        else rest
    )
    sizes = model.sizes
    kv = (
        2
        * sizes.num_layers
        * sizes.num_kv_heads
        * sizes.head_dim
        * int(round(context_tokens))
        * torch.tensor([], dtype=model.dtype).element_size()
    )
    parts = {
        "layers": layers,
        "final_norm": rest - layers,
        "lm_head": _nbytes(head),
        "embed_rows": new_tokens * embed.shape[-1] * embed.element_size(),
        "kv_cache": kv,
    }
    return {**parts, "total": sum(parts.values())}


def drafter_modules(proposer: Proposer, target: TargetDecoder, depth: int = 3) -> list[nn.Module]:
    """The nn.Modules a proposer drafts with (its heads, its drafter), found through its attributes
    and those of draftsmith helper objects it holds (an EAGLE proposer's serving model); never the
    target itself.
    """
    found: list[nn.Module] = []
    seen: set[int] = set()

    def walk(obj: Any, level: int) -> None:
        if id(obj) in seen or obj is target or level > depth:
            return
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            found.append(obj)
            return
        if not type(obj).__module__.startswith("draftsmith.") or not hasattr(obj, "__dict__"):
            return
        for value in vars(obj).values():
            if isinstance(value, nn.Module) or hasattr(value, "__dict__"):
                walk(value, level + 1)

    walk(proposer, 0)
    return found


def drafter_call_bytes(proposer: Proposer, target: TargetDecoder) -> dict[str, int]:
    """Bytes one drafter call reads: every floating tensor of its modules once (the target's LM head
    too when the drafter holds it, e.g. EAGLE-1 and Medusa heads sharing it), except the token
    embedding, of which one row is read. A tensor counts as the embedding when every name holding it
    says ``embed``."""
    embed_ptr, head_ptr = target.embed_weight.data_ptr(), target.lm_head_weight.data_ptr()
    tensors: dict[int, tuple[list[str], torch.Tensor]] = {}
    for module in drafter_modules(proposer, target):
        for ptr, (names, t) in _floating(module).items():
            tensors[ptr] = ([*tensors.get(ptr, ([], t))[0], *names], t)
    own = shared_head = rows = 0
    for ptr, (names, t) in tensors.items():
        if all("embed" in n for n in names):
            rows += t.shape[-1] * t.element_size()  # one gathered row per call
        elif ptr == head_ptr or ptr == embed_ptr:
            shared_head += _nbytes(t)
        else:
            own += _nbytes(t)
    return {
        "drafter_weights": own,
        "target_lm_head": shared_head,
        "embed_rows": rows,
        "total": own + shared_head + rows,
    }


@contextmanager
def counting_draft_calls(proposer: Proposer, target: TargetDecoder) -> Iterator[dict[str, int]]:
    """Count drafter calls while the block runs: ``{"calls": n}``. A proposer that declares
    ``counts_draft_calls`` (EAGLE: one ``draft_calls`` per drafter forward, whose native path never
    enters an nn.Module's forward; Medusa) is read from its own counter; otherwise a forward of any
    top drafter module counts. Zero when the proposer drafts through methods other than a forward
    (then one call per step is assumed)."""
    counter = {"calls": 0}

    def bump(*_: Any) -> None:
        counter["calls"] += 1

    counts = bool(proposer.counts_draft_calls)
    before = proposer.draft_calls if counts else 0
    hooks = (
        []
        if counts
        else [m.register_forward_pre_hook(bump) for m in drafter_modules(proposer, target)]
    )
    try:
        yield counter
    finally:
        if counts:
            counter["calls"] = proposer.draft_calls - before
        for hook in hooks:
            hook.remove()


def _row(
    measured_ms: float | None, floor_ms: float | None, target: float | None = None
) -> dict[str, Any]:
    """Measured ms, floor ms, their ratio and, with a ``target`` ratio, whether it was met (None:
    not measured)."""
    ratio = measured_ms / floor_ms if measured_ms is not None and floor_ms else None
    row = {"measured_ms": measured_ms, "floor_ms": floor_ms, "ratio": ratio}
    if target is not None:
        row.update(target=target, met=None if ratio is None else ratio <= target)
    return row


def step_floors(
    model: nn.Module,
    proposer: Proposer,
    profile: dict[str, Any],
    steps: dict[str, float],
    ar_step_ms: float,
    bandwidth_gbs: float,
    threads: int | None = None,
) -> dict[str, Any]:
    """Measured against floor for the AR step, the verify forward and drafting.

    ``profile``: a :class:`~draftsmith.runtime.decoding.profile.StepProfiler` report; ``steps``:
    what the profiled steps did on average: ``context_tokens`` (mean cached length), ``tree_nodes``
    (verified per step, root included), ``draft_calls`` (drafter calls per step), optionally
    ``ar_context_tokens`` (the AR steps' mean cached length, default ``context_tokens``);
    ``ar_step_ms``: the plain decode step without prefill; ``threads``: those the bandwidth was
    measured with (recorded; default the current count)."""
    ms_per_byte = 1e3 / (bandwidth_gbs * 1e9)
    ctx, nodes = steps["context_tokens"], max(1, int(round(steps["tree_nodes"])))
    ar_ctx = steps.get("ar_context_tokens", ctx)
    ar_bytes = decoder_step_bytes(model, ar_ctx)
    verify_bytes = decoder_step_bytes(model, ctx, nodes)
    call = drafter_call_bytes(proposer, model)
    calls, drafted = max(steps["draft_calls"], 1e-9), max(steps["tree_nodes"] - 1, 0.0)
    draft_ms = profile.get("draft_ms")
    per_call = _row(
        None if draft_ms is None else draft_ms / calls, call["total"] * ms_per_byte, DRAFT_TARGET
    )
    per_token = _row(
        draft_ms / drafted if draft_ms is not None and drafted else None,
        call["total"] * ms_per_byte * calls / drafted if drafted else None,
        DRAFT_TARGET,
    )
    return {
        "bandwidth_gbs": bandwidth_gbs,
        "threads": threads or torch.get_num_threads(),
        "cpu": cpu_caps.probe().describe(),
        "context_tokens": ctx,
        "ar_context_tokens": ar_ctx,
        "ar_step_bytes": ar_bytes,
        "draft_call_bytes": call,
        "draft_calls_per_step": steps["draft_calls"],
        "drafted_tokens_per_step": drafted,
        "draft_calls_source": steps.get("draft_calls_source", "counted"),
        "ar_step": _row(ar_step_ms, ar_bytes["total"] * ms_per_byte, AR_TARGET),
        "verify_forward": {
            **_row(profile.get("verify_forward_ms"), verify_bytes["total"] * ms_per_byte),
            "new_tokens": nodes,
        },
        "draft_per_call": per_call,
        "draft_per_token": per_token,
    }


def verdicts(floors: dict[str, Any]) -> list[str]:
    """One line per target: ``"AR step 1.42x floor (target 1.3x): missed"``."""
    lines = []
    for key, label in (("ar_step", "AR step"), ("draft_per_token", "drafted token")):
        row = floors[key]
        if row["ratio"] is None:
            lines.append(f"{label}: not measured (target {row['target']}x)")
        else:
            lines.append(
                f"{label} {row['ratio']:.2f}x floor (target {row['target']}x): "
                f"{'met' if row['met'] else 'missed'}"
            )
    return lines


def apply_profiled_shape(
    spec: SpeculativeDecoder, export_proposer: Proposer, cost_model: dict[str, Any] | None
) -> str:
    """Put on ``spec`` the draft shape ``bench --profile`` profiles when plain decoding is served:
    the best measured shape of the cost model, else the export's proposer. Returns what was
    profiled, for the report.
    """
    from draftsmith.runtime.shapes import (
        draft_shapes,
    )  # only --profile needs it (the serving walk stays short)

    timed = [
        r
        for r in (cost_model or {}).get("table", [])
        if r["shape"] != draft_shapes.PLAIN.label and r.get("measured_speedup") is not None
    ]
    if timed:
        best = max(timed, key=lambda r: r["measured_speedup"])
        draft_shapes.apply_shape(spec, draft_shapes.Shape.from_dict(best["spec"]), export_proposer)
        return f"{best['shape']} (the best measured shape; plain decoding is served)"
    spec.proposer = export_proposer
    return "the export's proposer (plain decoding is served)"
