"""The curve folder's record, ``curve.json``: its file names, the :class:`Curve` it holds (plan,
evaluation settings, measured step costs, every finished point), started or resumed and refusing a
folder started otherwise, and written atomically."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from draftsmith.common.errors import DraftsmithError
from draftsmith.evals.learning_curve import EvalSettings
from draftsmith.runtime.shapes.cost_model import MachineCosts

CURVE_FILE, RUN_DIR, POINTS_DIR = "curve.json", "run", "points"


class CurveError(DraftsmithError, ValueError):
    """A curve that cannot run as asked (bad plan, another curve in the folder, a failed training
    segment)."""


def read_curve(path: Path) -> dict[str, Any]:
    """A kept curve.json (written atomically, so damage came from outside); one line when it does
    not parse."""
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise CurveError(
            f"{path} is corrupt ({err}): restore it, or start another --out (every point's export"
            " and evaluation stay in its points/ folder)"
        ) from None


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed over it (never a half-written
    curve.json)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


class Curve:
    """The state of one curve folder (``curve.json``), loaded or started, refusing a folder started
    otherwise."""

    def __init__(
        self,
        out: str | Path,
        overrides: Sequence[str],
        plan: list[int],
        settings: EvalSettings,
        cooldown: float = 0.0,
    ) -> None:
        self.out = Path(out)
        self.path = self.out / CURVE_FILE
        fresh = {
            "format": "draftsmith-curve",
            "version": 1,
            "overrides": list(overrides),
            "plan": plan,
            "settings": json.loads(
                json.dumps(asdict(settings))
            ),  # tuples as lists, as curve.json reads back
            "cooldown": float(cooldown),
            "costs": None,
            "costs_contention": None,
            "machine": machine(),
            "points": [],
        }
        if self.path.is_file():
            self.data = read_curve(self.path)
            self.data.setdefault(
                "cooldown", float(cooldown)
            )  # a curve from before branches: its points stay raw
            for key in ("overrides", "settings", "cooldown"):
                if self.data.get(key) != fresh[key]:
                    raise CurveError(
                        f"{self.path} was started with {key} {self.data.get(key)!r}, now"
                        f" {fresh[key]!r}: re-run with the same arguments to resume, or pick"
                        " another --out"
                    )
            self.data["plan"] = extended_plan(self.data, plan, self.path)
        else:
            self.out.mkdir(parents=True, exist_ok=True)
            self.data = fresh
        self.settings = settings

    def done(self, steps: int) -> dict[str, Any] | None:
        """The finished point at ``steps``, if any."""
        return next((p for p in self.data["points"] if p["steps"] == steps), None)

    def costs(self) -> MachineCosts | None:
        """The step costs the curve predicts speedups with (None before the first measurement)."""
        return costs_of(self.data)

    def wants_costs(self) -> bool:
        """Whether the next evaluation should measure the step costs: none yet, or only contended
        ones."""
        kept = self.data.get("costs_contention")
        return self.data.get("costs") is None or bool(kept and kept.get("contended"))

    def add(self, point: dict[str, Any], measured: dict[str, Any] | None) -> None:
        """Record a finished point atomically, and measured costs when they are the first or replace
        contended ones with quiet ones (costs timed beside other processes predict nothing about
        this machine)."""
        if measured is not None and (
            self.data.get("costs") is None or not measured["contention"]["contended"]
        ):
            self.data["costs"], self.data["costs_contention"] = (
                measured["costs"],
                measured["contention"],
            )
        self.data["points"] = sorted([*self.data["points"], point], key=lambda p: p["steps"])
        write_json(self.path, self.data)


def extended_plan(data: dict[str, Any], requested: list[int], path: Path) -> list[int]:
    """The plan a kept curve runs under ``requested``: its own, or its own extended by the requested
    points beyond its last one (a larger ``--steps``). Only an extension is allowed: with a constant
    learning rate the kept points stand whatever comes after them, but a point before the run's end
    cannot be trained again."""
    plan = [int(s) for s in data["plan"]]
    asked = [list(map(int, p)) for p in data.get("requested_plans", [plan])]
    if requested == plan or requested in asked:
        return plan
    if requested[-1] <= plan[-1]:
        raise CurveError(
            f"{path} was started with plan {plan}, now {requested}: re-run with the same arguments"
            " to resume, a larger --steps to extend it, or pick another --out"
        )
    data["requested_plans"] = [*asked, requested]
    return [*plan, *(s for s in requested if s > plan[-1])]


def costs_of(data: dict[str, Any]) -> MachineCosts | None:
    """The :class:`MachineCosts` a curve.json holds (None when none were measured)."""
    c = data.get("costs")
    return (
        None
        if c is None
        else MachineCosts(**{**c, "verify_ms": {int(k): v for k, v in c["verify_ms"].items()}})
    )


def machine() -> dict[str, Any]:
    """The CPU the curve ran on (every figure is named with it)."""
    from draftsmith.kernels import cpu_caps

    return {"cpu": cpu_caps.probe().describe(), "cores": os.cpu_count()}
