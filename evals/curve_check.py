"""``draftsmith curve --out DIR --check RUN_DIR``: does the curve's forecast hold for a finished
run?

``RUN_DIR`` is a finished training run (a cosine schedule to its end, say) with more training tokens
than any of the curve's readings, or its export folder. Its export is evaluated exactly as the
curve's points (same held-out prompts, tokens and dtype; kept in
``DIR/checks/<fingerprint>/eval.json`` so a re-run does not evaluate again), and the curve's
forecast at the run's tokens, with its interval (:func:`draftsmith.evals.curve_forecast.check`), is
set against it. The verdict is stored in ``curve.json`` (``checks``) and shown in ``curve.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from draftsmith.evals.cooldown import read_json
from draftsmith.evals.curve_forecast import check, furthest_tokens

CHECKS_DIR = "checks"


def finished_export(run: Path) -> Path:
    """The export of a run folder (``RUN/export``), or ``run`` itself when it is an export
    folder."""
    if (run / "export" / "config.json").is_file():
        return run / "export"
    return run


def recipe_of(overrides: list[str]) -> str | None:
    """The ``recipe=NAME`` a curve was started with."""
    return next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "recipe"), None)


def checked_export(data: dict[str, Any], run: Path) -> tuple[Path, dict[str, Any]]:
    """The run's export and config, refused in one line when it is missing, damaged, of another
    method or not past the curve's furthest reading."""
    from draftsmith.evals.curve_folder import CurveError
    from draftsmith.export.format import ExportError, read_export

    export = finished_export(run)
    try:
        config, _ = read_export(
            export
        )  # reads the weights too: a truncated file is refused here, not mid-bench
    except ExportError as err:
        raise CurveError(f"--check {run}: {err}") from None
    recipe = recipe_of(list(data["overrides"]))
    if recipe is not None and config["method"] != recipe:
        raise CurveError(
            f"--check {run}: a {config['method']} export, and this curve trains recipe={recipe}: "
            "check it against a curve of its own method"
        )
    tokens = int((config.get("training") or {}).get("tokens") or 0)
    furthest = furthest_tokens(data)
    if tokens <= furthest:
        raise CurveError(
            f"--check {run}: it trained {tokens:,} tokens, not more than the curve's furthest"
            f" reading ({furthest:,}): a forecast is checked at a larger budget than any point"
        )
    return export, config


def run_check(
    curve_dir: str | Path,
    run: str | Path,
    evaluate: Callable[..., Any] | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Evaluate the finished run ``run`` like the curve's points, set the curve's forecast at its
    tokens against it, store the verdict in curve.json and rewrite the report; returns the check's
    record."""
    from draftsmith.evals.curve_folder import CURVE_FILE, CurveError, read_curve, write_json
    from draftsmith.evals.curve_report import write_report
    from draftsmith.evals.learning_curve import EvalSettings, evaluate_export
    from draftsmith.export.stacking import export_fingerprint

    curve_dir, run = Path(curve_dir), Path(run)
    if not (curve_dir / CURVE_FILE).is_file():
        raise CurveError(f"{curve_dir / CURVE_FILE} not found: run the curve first")
    data = read_curve(curve_dir / CURVE_FILE)
    export, config = checked_export(data, run)
    fingerprint = export_fingerprint(export)
    kept_path = curve_dir / CHECKS_DIR / fingerprint.split(":")[-1][:16] / "eval.json"
    kept = read_json(kept_path)
    if kept is None:
        say(f"evaluating {export} on the curve's held-out prompts")
        settings = EvalSettings(
            **{**data["settings"], "prompt_sets": tuple(data["settings"]["prompt_sets"])}
        )
        evaluation, _ = (evaluate or evaluate_export)(str(export), settings, measure=False)
        kept = {"eval": evaluation, "export": str(export)}
        kept_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(kept_path, kept)
    tokens = int(config["training"]["tokens"])
    record = {
        **check(data, str(run), tokens, kept["eval"]),
        "fingerprint": fingerprint,
        "steps": (config.get("training") or {}).get("steps"),
    }
    data["checks"] = [
        c for c in data.get("checks") or [] if c.get("fingerprint") != fingerprint
    ] + [record]
    write_report(curve_dir, data)
    return record
