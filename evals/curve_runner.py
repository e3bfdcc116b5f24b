"""``draftsmith curve``: train one recipe in segments and evaluate an export at log-spaced step
counts, so acceptance can be read against training tokens and CPU-hours.

Folder (``--out DIR``), every stage resumable by re-running the same command::

    DIR/curve.json                plan, evaluation settings, measured step costs, every finished
                                  point (atomic)
    DIR/run/                      the one training run (Hydra run dir): checkpoints, CSV logs,
                                  its latest export
    DIR/points/step<N>/export/    the export evaluated at step N (copied from run/export, then
                                  swapped in)
    DIR/points/step<N>/eval.json  its evaluation (kept, so a resumed curve never evaluates twice)
    DIR/points/step<N>/cooled/    the cooldown branch's export and evaluation
                                  (:mod:`draftsmith.evals.cooldown`)
    DIR/branches/step<N>/         the cooldown branch's own run folder (the main run is never
                                  written by it)
    DIR/curve.md, DIR/curve.png   the table and the picture (:mod:`draftsmith.evals.curve_report`)

Training runs as ``draftsmith train`` subprocesses with ``trainer.max_steps`` raised segment by
segment; each resumes from ``run/checkpoints/last.ckpt``. The learning rate is constant after
warm-up (``optim.scheduler=constant`` unless the overrides name one) so that a point's weights do
not depend on where the curve ends. A killed segment resumes from its last checkpoint; a point whose
export exists but was not evaluated is evaluated; a finished point is kept. Each point is read
twice: raw (the main run's weights at step N, constant LR) and cooled (a branch from step N whose LR
decays linearly to zero over ``--cooldown`` x N more steps), which predicts a finished run of N +
that many steps; the fit and ``--compare`` read the cooled values. CPU-hours are the CPU time the
training processes used (``getrusage`` of the children), not wall time x cores, so a segment that
shared the machine is billed for its own work only; a cooled reading is billed the main run's
CPU-hours at its branch point plus the branch's own.
"""

from __future__ import annotations

import csv
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from draftsmith.common.errors import DraftsmithError
from draftsmith.evals.cooldown import (
    BranchError,
    check_fraction,
    cooled_record,
    read_json,
    run_branch,
)
from draftsmith.evals.curve_bill import CacheBillError, billed_cache_seconds, feature_cache_bill
from draftsmith.evals.learning_curve import EvalSettings, evaluate_export
from draftsmith.runtime.shapes.cost_model import MachineCosts

CURVE_FILE, RUN_DIR, POINTS_DIR = "curve.json", "run", "points"
# The curve evaluates each point itself: training's own end-of-run validation shrinks to one batch,
# its served-tau probe is off, and the learning rate stays constant after warm-up.
DEFAULT_OVERRIDES = {
    "optim.scheduler": "constant",
    "validation.served_tau.every": "0",
    "run.final_eval_batches": "1",
}
PROTECTED = (
    "hydra.run.dir",
    "trainer.max_steps",
    "trainer.max_time",
)  # the curve sets these itself
DEFAULT_COOLDOWN = (
    0.2  # a branch decays over 20% of the point's steps (Hagele et al. find 10-20% enough)
)


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


def check_prompt_sets(prompt_sets: Sequence[str]) -> None:
    """Refuse a prompt set the evaluation could not load (``mtbench``, ``humaneval``, a .jsonl,
    ``NAME[a:b]``: read as :func:`~draftsmith.common.prompt_sets.prompt_texts` reads it) before any
    training: one line naming it.
    """
    from draftsmith.common.prompt_sets import prompt_texts

    for spec in prompt_sets:
        try:
            texts = prompt_texts(spec)
        except (OSError, ValueError) as err:
            why = str(err).removeprefix(f"prompts {spec}: ")  # the flag names the set already
            raise CurveError(f"--prompts {spec}: {why}; nothing was trained") from None
        if not texts:
            raise CurveError(f"--prompts {spec}: no prompts in it; nothing was trained")


def log_spaced_steps(first: int, last: int, points: int) -> list[int]:
    """``points`` step counts from ``first`` to ``last``, evenly spaced in log, distinct and
    increasing."""
    if first < 1 or last < first or points < 1:
        raise CurveError(
            f"need 1 <= --first-steps <= --steps and --points >= 1, got first={first}, last={last},"
            f" points={points}"
        )
    if points == 1:
        return [last]
    ratio = (last / first) ** (1.0 / (points - 1))
    steps = sorted({max(1, round(first * ratio**i)) for i in range(points)} | {last})
    return steps


def training_overrides(user: Sequence[str]) -> list[str]:
    """The user's overrides plus the curve's defaults for keys the user left alone; refuses keys the
    curve sets."""
    keys = {o.lstrip("+~").split("=", 1)[0] for o in user}
    clash = sorted(keys & set(PROTECTED))
    if clash:
        raise CurveError(
            f"{', '.join(clash)} is set by the curve itself (--out, --steps); leave it out"
        )
    if not any(k == "recipe" for k in keys):
        raise CurveError("name a recipe, e.g. `draftsmith curve --out DIR recipe=eagle3`")
    return [*user, *(f"{k}={v}" for k, v in DEFAULT_OVERRIDES.items() if k not in keys)]


def tokens_seen(run_dir: Path) -> int | None:
    """Non-padding tokens the run has trained on: its export's exact count (``training.tokens``),
    else the largest ``train/tokens`` in its CSV logs (logged every few steps, so a short segment
    may log none)."""
    try:
        exact = (
            json.loads((run_dir / "export" / "config.json").read_text())
            .get("training", {})
            .get("tokens")
        )
    except (OSError, ValueError, AttributeError):
        exact = None
    if isinstance(exact, int) and exact > 0:
        return exact
    best = None
    for path in run_dir.rglob("metrics.csv"):
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                value = row.get("train/tokens")
                if value:
                    best = max(best or 0, int(float(value)))
    return best


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed over it (never a half-written
    curve.json)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def copy_export(source: Path, dest: Path) -> None:
    """Copy an export folder to ``dest`` beside-then-rename, so ``dest`` exists only complete."""
    if not (source / "config.json").is_file():
        raise CurveError(f"training finished without an export in {source} (run.export=false?)")
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)


def children_cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process's finished children (the training
    segments)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def train_to(
    run_dir: Path,
    overrides: Sequence[str],
    steps: int,
    runner: Callable[[list[str]], int],
) -> tuple[float, float]:
    """Train (or resume) ``run_dir`` (the main run, or a cooldown branch) until ``steps``: (wall
    seconds, CPU seconds) it took. CPU seconds are what the training process itself used, so a
    segment that shared the machine is not billed for the others' time."""
    argv = [*overrides, f"hydra.run.dir={run_dir}", f"trainer.max_steps={steps}"]
    start, cpu = time.perf_counter(), children_cpu_seconds()
    code = runner(argv)
    if code != 0:
        raise CurveError(
            f"training segment to step {steps} failed (exit {code}); fix the error above and re-run"
            " the same `draftsmith curve` command: it resumes from the last checkpoint"
        )
    return time.perf_counter() - start, children_cpu_seconds() - cpu


def subprocess_train(argv: list[str]) -> int:
    """Run ``draftsmith train ARGV`` in a child process (a fresh Hydra app per segment)."""
    return subprocess.call([sys.executable, "-m", "draftsmith.cli", "train", *argv])


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


def _main_segment(
    curve: Curve, overrides: Sequence[str], steps: int, runner: Callable[[list[str]], int]
) -> tuple[Path, dict[str, Any]]:
    """Train the main run to ``steps`` unless its export is already kept: (the point's export, its
    training record)."""
    point_dir = curve.out / POINTS_DIR / f"step{steps}"
    export, meta_path = point_dir / "export", point_dir / "training.json"
    if not (export / "config.json").is_file() or not meta_path.is_file():
        seconds, cpu = train_to(curve.out / RUN_DIR, overrides, steps, runner)
        point_dir.mkdir(parents=True, exist_ok=True)
        copy_export(curve.out / RUN_DIR / "export", export)
        before = [p for p in curve.data["points"] if p["steps"] < steps]
        write_json(
            meta_path,
            {
                "steps": steps,
                "segment_seconds": seconds,
                "segment_cpu_seconds": cpu,
                "train_seconds_total": (
                    seconds + (before[-1]["train_seconds_total"] if before else 0.0)
                ),
                "train_cpu_seconds_total": (
                    cpu + (before[-1].get("train_cpu_seconds_total") or 0.0 if before else 0.0)
                ),
                "tokens": tokens_seen(curve.out / RUN_DIR),
            },
        )
    return export, read_json(meta_path)


def _evaluated(
    export: Path,
    settings: EvalSettings,
    measure: bool,
    evaluate: Callable[..., Any],
) -> tuple[dict[str, Any], dict | None]:
    """``evaluate`` of ``export``, kept beside it (``eval.json``) so a resumed curve never evaluates
    twice."""
    path = export.parent / "eval.json"
    kept = read_json(path)
    if kept is None:
        evaluation, measured = evaluate(str(export), settings, measure=measure)
        kept = {"eval": evaluation, "measured": measured}
        write_json(path, kept)
    return kept["eval"], kept["measured"]


def _cooled(
    curve: Curve,
    overrides: Sequence[str],
    steps: int,
    runner: Callable[[list[str]], int],
    evaluate: Callable[..., Any],
    say: Callable[[str], None],
) -> dict[str, Any] | None:
    """The point's cooldown branch, trained and evaluated (None when branches are off or the main
    run's checkpoint at ``steps`` is gone: a point kept from before branches)."""
    fraction = float(curve.data.get("cooldown") or 0.0)
    if fraction <= 0:
        return None
    try:
        export, meta = run_branch(
            curve.out,
            overrides,
            steps,
            fraction,
            runner,
            train_to,
            copy_export,
            tokens_seen,
            write_json,
        )
    except BranchError as err:
        if "keeps no step" not in str(err):
            raise
        say(f"step {steps}: {err}")
        return None
    evaluation, _ = _evaluated(export, curve.settings, False, evaluate)
    return cooled_record(meta, evaluation, export, curve.out)


def run_point(
    curve: Curve,
    overrides: Sequence[str],
    steps: int,
    runner: Callable[[list[str]], int],
    evaluate: Callable[..., tuple[dict[str, Any], dict | None]] = evaluate_export,
    say: Callable[[str], None] = print,
) -> dict:
    """Train to ``steps`` (unless its export is already kept), evaluate it, branch its cooldown
    (trained from the step-``steps`` checkpoint, evaluated alike) and record the point with both
    values."""
    export, meta = _main_segment(curve, overrides, steps, runner)
    evaluation, measured = _evaluated(export, curve.settings, curve.wants_costs(), evaluate)
    cooled = _cooled(curve, overrides, steps, runner, evaluate, say)
    cores = curve.data["machine"]["cores"] or 1
    cpu_total = meta.get(
        "train_cpu_seconds_total"
    )  # absent in folders written before it was measured
    cache = billed_cache_seconds(curve.data.get("feature_cache"), meta["tokens"])
    point = {
        "steps": steps,
        "tokens": meta["tokens"],
        "train_seconds_total": meta["train_seconds_total"],
        "train_cpu_seconds_total": cpu_total,
        "cache_cpu_seconds": cache,
        "cpu_hours": (
            ((cpu_total if cpu_total else meta["train_seconds_total"] * cores) + (cache or 0.0))
            / 3600.0
        ),
        "export": str(export.relative_to(curve.out)),
        "eval": evaluation,
        "cooled": cooled,
    }
    curve.add(point, measured)
    return point


def _firsts(evaluation: dict[str, Any] | None) -> dict[str, float]:
    return {
        k: round(v["first_position_acceptance"], 3)
        for k, v in (evaluation or {}).items()
        if isinstance(v, dict) and "first_position_acceptance" in v
    }


def run_curve(
    out: str | Path,
    user_overrides: Sequence[str],
    plan: list[int],
    settings: EvalSettings,
    runner: Callable[[list[str]], int] = subprocess_train,
    evaluate: Callable[..., tuple[dict[str, Any], dict | None]] = evaluate_export,
    say: Callable[[str], None] = print,
    cooldown: float = DEFAULT_COOLDOWN,
) -> Curve:
    """Run (or resume) the curve in ``out``: every planned point trained, exported, branched
    (``cooldown``: the share of its steps the branch decays over; 0 = no branches) and evaluated, in
    order. The prompt sets are checked before anything trains."""
    overrides = training_overrides(user_overrides)
    check_fraction(cooldown, overrides)
    check_prompt_sets(settings.prompt_sets)
    curve = Curve(out, overrides, plan, settings, cooldown)
    try:
        bill = feature_cache_bill(overrides)
    except CacheBillError as err:
        raise CurveError(str(err)) from None
    if bill is not None:
        if bill["cpu_seconds"] is None:
            say(
                f"the feature cache {bill['path']} did not record what it cost to build (written by"
                " an older version): CPU-hours count the drafter's training only"
            )
        curve.data["feature_cache"] = bill
    if curve.data["plan"] != plan:
        say(f"extending the kept curve: plan {curve.data['plan']} (its finished points are kept)")
    plan = curve.data["plan"]
    for i, steps in enumerate(plan, 1):
        if curve.done(steps):
            say(f"[{i}/{len(plan)}] step {steps}: kept from an earlier run")
            continue
        say(
            f"[{i}/{len(plan)}] step {steps}: training (resumes from the last checkpoint), a"
            " cooldown branch and evaluating"
        )
        point = run_point(curve, overrides, steps, runner, evaluate, say)
        cooled = point["cooled"] or {}
        say(
            f"[{i}/{len(plan)}] step {steps}: {point['tokens']} tokens, {point['cpu_hours']:.2f}"
            f" CPU-h, first-position acceptance {_firsts(point['eval'])}, cooled"
            f" {_firsts(cooled.get('eval')) or '-'}"
        )
    return curve
