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

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from draftsmith.evals.cooldown import (
    BranchError,
    check_fraction,
    cooled_record,
    read_json,
    run_branch,
)
from draftsmith.evals.curve_bill import CacheBillError, billed_cache_seconds, feature_cache_bill
from draftsmith.evals.curve_folder import POINTS_DIR, RUN_DIR, Curve, CurveError, write_json
from draftsmith.evals.curve_training import (
    copy_export,
    subprocess_train,
    tokens_seen,
    train_to,
    training_overrides,
)
from draftsmith.evals.learning_curve import EvalSettings, evaluate_export

# a branch decays over 20% of the point's steps (Hagele et al. find 10-20% enough)
DEFAULT_COOLDOWN = 0.2


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
