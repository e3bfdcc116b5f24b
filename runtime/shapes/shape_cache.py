"""The per-machine cache of cost-aware shape decisions: its key (what the measured costs depend
on: :func:`machine_identity`), where it lives, writing and reading a decision, and reapplying the
cached one when a command serves (:func:`apply_cached_shape`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from draftsmith.kernels import cpu_caps
from draftsmith.runtime.acceptance.stop_policies import FixedDepth
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import NullProposer
from draftsmith.runtime.shapes import draft_shapes
from draftsmith.runtime.shapes.cost_model import MachineCosts, ShapeChoice

if TYPE_CHECKING:
    from draftsmith.runtime.serving import (
        Runtime,
    )  # the runtime imports no shape code: no cycle at run time


def machine_identity(runtime: Runtime) -> dict[str, Any]:
    """What the measured costs depend on: CPU, threads, target, dtype, linear backend, the drafter
    export."""
    return {
        "cpu": cpu_caps.probe().describe(),
        "threads": torch.get_num_threads(),
        "target": runtime.folder,
        "dtype": str(runtime.model.dtype),
        "linears": runtime.model.linear_ops,
        "export": (
            (runtime.export_config or {}).get("fingerprint")
            or (runtime.export_config or {}).get("target")
        ),
        "method": (runtime.export_config or {}).get("method"),
    }


def cache_key(parts: dict[str, Any]) -> str:
    """A stable key for (machine, target, dtype, backend, drafter)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_dir() -> Path:
    """Where measured costs are kept (``DRAFTSMITH_COST_CACHE`` or ~/.cache/draftsmith/costs)."""
    return Path(
        os.environ.get("DRAFTSMITH_COST_CACHE", Path.home() / ".cache" / "draftsmith" / "costs")
    )


def save_shape_choice(
    key: str, costs: MachineCosts, choice: ShapeChoice, identity: dict[str, Any]
) -> Path:
    """Write the measured costs and the shape decision atomically (``generate`` reapplies the
    shape)."""
    path = cache_dir() / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "identity": identity,
                "costs": asdict(costs),
                "shape": asdict(choice.shape),
                "depth": choice.depth,
                "why": choice.why,
                "predicted_speedup": choice.predicted_speedup,
                "measured_speedup": choice.measured_speedup,
                "table": choice.table,
            },
            indent=1,
        )
    )
    tmp.replace(path)
    return path


def load_choice(key: str) -> dict[str, Any] | None:
    """The cached decision for ``key``, or None (never measured here, or unreadable)."""
    path = cache_dir() / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def apply_cached_shape(runtime: Runtime) -> str:
    """Apply the shape ``draftsmith bench`` chose for this machine and export (cached), or keep the
    export's own when it never ran here. Returns what was done, for the user."""
    cached = load_choice(cache_key(machine_identity(runtime)))
    if cached is None:
        return (
            "not calibrated on this machine: the export's stop policy runs (draftsmith bench"
            " calibrates it)"
        )
    if "shape" not in cached:  # a decision cached before shapes: a depth
        apply_depth(runtime.speculative, int(cached["depth"]))
        return f"draft depth {cached['depth']} (calibrated by draftsmith bench)"
    shape = draft_shapes.Shape.from_dict(cached["shape"])
    draft_shapes.apply_shape(runtime.speculative, shape)
    if shape.kind == "plain":
        return f"{cached['why']} (--stop-policy export forces the export's policy)"
    return f"draft shape {shape.label}: {cached['why']} (calibrated by draftsmith bench)"


def apply_depth(spec: SpeculativeDecoder, depth: int) -> None:
    """Cap the draft depth at ``depth`` (keeping the policy's own rule), or serve plain decoding for
    0."""
    if depth == 0:
        spec.proposer = NullProposer()
        return
    policy = spec.stop_policy
    spec.stop_policy = (
        FixedDepth(depth)
        if policy is None
        else dataclasses.replace(policy, max_depth=min(depth, policy.max_depth))
    )
