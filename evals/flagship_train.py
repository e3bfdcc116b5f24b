"""``make train-best``'s driver (``draftsmith flagship train --root DIR -- OVERRIDES``): sittings
that keep training the flagship, so tokens accumulate across sittings and machines.

The state lives under ``DIR`` (``$DRAFTSMITH_CACHE/train-best`` by default), one run folder per
training run::

    DIR/runs/001/  a ``train.py`` run folder (checkpoints, logs, export), its plan in plan.json
    DIR/current    a link to the run the last sitting trained (what ``make train-best`` ships)

A sitting resumes the newest run while it is unfinished (its export has fewer steps than planned: a
sitting stopped by ``trainer.max_time``, Ctrl-C, SIGTERM or ``kill -9`` goes on from its last
checkpoint, on its own schedule). Once that run is finished, the next sitting starts a new run
warm-started (``run.init_from``) from whichever drafter has trained on the most tokens: the shipped
flagship or the newest finished run here (a candidate that did not gain enough to ship still keeps
its tokens on this machine); ``--init none`` trains from scratch, ``--init PATH`` from that export.
Candidates of another method than the recipe are skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RUNS, CURRENT, PLAN = "runs", "current", "plan.json"


def _config(export: Path) -> dict[str, Any] | None:
    try:
        return json.loads((export / "config.json").read_text())
    except (OSError, ValueError):
        return None


def tokens_of(config: dict[str, Any]) -> int:
    """Tokens a drafter has trained on in all (its lineage's total, else its own run's)."""
    training = config.get("training") or {}
    return int((training.get("lineage") or {}).get("tokens_total") or training.get("tokens") or 0)


def recipe_of(overrides: Sequence[str]) -> str | None:
    """The ``recipe=NAME`` among the overrides."""
    return next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "recipe"), None)


def newest_run(root: Path) -> Path | None:
    """The newest run folder under ``root/runs``."""
    runs = sorted(p for p in (root / RUNS).glob("[0-9][0-9][0-9]") if p.is_dir())
    return runs[-1] if runs else None


def finished(run: Path) -> bool:
    """Whether ``run`` trained all its planned steps (its export says so); a run without a plan
    counts as finished."""
    try:
        plan = json.loads((run / PLAN).read_text())
    except (OSError, ValueError):
        return True
    config = _config(run / "export")
    return config is not None and int((config.get("training") or {}).get("steps") or 0) >= int(
        plan["max_steps"]
    )


def start_point(root: Path, flagship: Path | None, method: str | None, init: str) -> Path | None:
    """The export a new run warm-starts from (None: from scratch): ``init`` as given, or for
    ``auto`` the one of the shipped flagship and the newest finished run here that has trained on
    the most tokens."""
    if init == "none":
        return None
    if init != "auto":
        return Path(init)
    run = newest_run(root)
    candidates = [p for p in (run / "export" if run else None, flagship) if p is not None]
    scored = [
        (tokens_of(c), i, p)
        for i, p in enumerate(candidates)
        if (c := _config(p)) is not None and (method is None or c.get("method") == method)
    ]
    return max(scored)[2] if scored else None


def max_steps_of(overrides: Sequence[str]) -> int:
    """``trainer.max_steps`` among the overrides (a sitting's plan needs it)."""
    value = next(
        (o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "trainer.max_steps"), None
    )
    if value is None:
        raise ValueError(
            "pass trainer.max_steps=N: a run is finished when it reaches it, and the next sitting "
            "warm-starts a new one"
        )
    return int(value)


def plan_sitting(
    root: Path,
    overrides: Sequence[str],
    flagship: Path | None,
    init: str,
    say: Callable[[str], None] = print,
) -> tuple[Path, list[str]]:
    """The run folder this sitting trains and the ``train.py`` arguments: the newest run resumed
    while unfinished, else a new one warm-started from :func:`start_point`."""
    from draftsmith.common.atomic_folder import write_file

    steps = max_steps_of(overrides)
    run = newest_run(root)
    if run is not None and not finished(run):
        plan = json.loads((run / PLAN).read_text())
        say(
            f"resuming {run} (step"
            f" {(_config(run / 'export') or {}).get('training', {}).get('steps', 0)} of"
            f" {plan['max_steps']} at its last export; its last checkpoint may be further)"
        )
        init_from = plan.get("init_from")
    else:
        start = start_point(root, flagship, recipe_of(overrides), init)
        number = int(run.name) + 1 if run is not None else 1
        run = root / RUNS / f"{number:03d}"
        init_from = str(start.resolve()) if start is not None else None
        say(
            f"new run {run}, "
            + (
                f"warm-started from {start} ({tokens_of(_config(start) or {}):,} tokens so far)"
                if start
                else "from scratch"
            )
        )
        write_file(
            run / PLAN,
            json.dumps(
                {"max_steps": steps, "init_from": init_from, "overrides": list(overrides)}, indent=1
            )
            + "\n",
        )
    link = root / f".{CURRENT}.tmp-{os.getpid()}"
    link.unlink(missing_ok=True)
    os.symlink(os.path.relpath(run, root), link)
    os.replace(link, root / CURRENT)
    argv = [
        *overrides,
        f"hydra.run.dir={run}",
        *([f"run.init_from={init_from}"] if init_from else []),
    ]
    return run, argv


def train_sitting(
    root: str | Path,
    overrides: Sequence[str],
    flagship: Path | None,
    init: str = "auto",
    runner: Callable[[list[str]], int] | None = None,
    say: Callable[[str], None] = print,
) -> tuple[Path, int]:
    """One sitting: plan it, then run ``train.py`` (a subprocess); returns (run folder, its exit
    status)."""
    run, argv = plan_sitting(Path(root), overrides, flagship, init, say)
    runner = runner or (
        lambda a: subprocess.call([sys.executable, "-m", "draftsmith.cli", "train", *a])
    )
    return run, runner(argv)
