"""Stand-ins for a learning curve's training segments and evaluations (tests/test_curve*.py): a
training that writes what ``draftsmith train`` writes (checkpoints, CSV tokens, export) and checks
that a cooldown branch starts from the main run's checkpoint without touching the main run, an
evaluation that reads a known law, and one whose first cost measurement is taken on a busy machine.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch

from draftsmith.runtime.shapes.cost_model import MachineCosts

# what a finished (cooled) run reads above the mid-run value at the same tokens, in the fake law
COOLED_GAIN = 0.05


def _arg(argv: list[str], key: str) -> str:
    return next(a.split("=", 1)[1] for a in argv if a.startswith(f"{key}="))


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


class FakeTraining:
    """Stands in for ``draftsmith train``: checkpoints (``{"global_step", "weights"}``, the newest
    two kept, as the real run does), ``last.ckpt``, a CSV of tokens (1,000 a step) and an export
    whose config says its steps and whether it is a cooldown branch. A branch must find its seed
    (the main run's checkpoint at the branch point); the main run's files must be exactly as its
    last segment left them. ``checkpoints=False`` writes no checkpoints: the curve then finds no
    seed to branch from and reads every point raw only."""

    def __init__(self, stop_at: int | None = None, checkpoints: bool = True) -> None:
        self.checkpoints = checkpoints
        self.calls: list[int] = []
        self.branch_argvs: list[list[str]] = []
        self.stop_at = stop_at
        self.main_snapshot: dict[str, str] | None = None
        self.main_dir: Path | None = None
        self.main_snapshots_checked = 0
        self.seen_seeds: list[dict] = []

    def __call__(self, argv: list[str]) -> int:
        run = Path(_arg(argv, "hydra.run.dir"))
        steps = int(_arg(argv, "trainer.max_steps"))
        if steps == self.stop_at:
            raise KeyboardInterrupt
        self.calls.append(steps)
        branch = "branches" in run.parts
        if branch:
            self.branch_argvs.append(list(argv))
            self._check_branch(run)
        if self.checkpoints:
            self._write_checkpoint(run, steps)
        self._write(run, steps, cooled=branch)
        if not branch:
            self.main_dir, self.main_snapshot = run, _digest(run)
        return 0

    def _check_branch(self, run: Path) -> None:
        last = run / "checkpoints" / "last.ckpt"
        assert last.exists(), f"the branch {run} starts without its seed"
        self.seen_seeds.append(torch.load(last, weights_only=True))
        if self.main_dir is not None:
            assert _digest(self.main_dir) == self.main_snapshot, (
                "a branch changed the main run's files"
            )
            self.main_snapshots_checked += 1

    @staticmethod
    def _write_checkpoint(run: Path, steps: int) -> None:
        folder = run / "checkpoints"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"global_step": steps, "weights": steps}, folder / f"step{steps}.ckpt")
        for old in sorted(folder.glob("step*.ckpt"), key=lambda p: int(p.stem[4:]))[:-2]:
            old.unlink()
        (folder / "last.ckpt").unlink(missing_ok=True)
        os.symlink(f"step{steps}.ckpt", folder / "last.ckpt")

    @staticmethod
    def _write(run: Path, steps: int, cooled: bool) -> None:
        (run / "export").mkdir(parents=True, exist_ok=True)
        (run / "export" / "config.json").write_text(
            json.dumps({"method": "fake", "steps": steps, "cooled": cooled})
        )
        (run / "logs").mkdir(exist_ok=True)
        (run / "logs" / "metrics.csv").write_text(
            "step,train/tokens\n" + f"{steps},{steps * 1000}\n"
        )


def law(tokens: float, cooled: bool) -> float:
    """The fake first-position acceptance after ``tokens``: 0.8 - 2 t^-0.3, plus :data:`COOLED_GAIN`
    once cooled."""
    return 0.8 - 2.0 * tokens**-0.3 + (COOLED_GAIN if cooled else 0.0)


def fake_evaluate(
    export: str,
    settings,
    measure: bool = False,
    steps: int | None = None,
    cooled: bool | None = None,
):
    """An evaluation that reads :func:`law` at the export's tokens (1,000 a step) for every prompt
    set."""
    config = json.loads((Path(export) / "config.json").read_text())
    steps = config.get("steps") if steps is None else steps
    cooled = bool(config.get("cooled")) if cooled is None else cooled
    first = law(steps * 1000, cooled)
    chain = [first, first * 0.7, first * 0.5, first * 0.3]
    conditional = [chain[0], *(b / a for a, b in zip(chain, chain[1:]))]
    table = [
        {
            "shape": "chain:1",
            "depth": 1,
            "tokens": 1 + first,
            "nodes": 2.0,
            "node_counts": {"2": 10},
        }
    ]
    record = {
        "first_position_acceptance": first,
        "chain_acceptance": chain,
        "conditional_acceptance": conditional,
        "shapes": table,
        "verify_steps": 400,
    }
    measured = None
    if measure:
        measured = {
            "costs": {
                "ar_step_ms": 10.0,
                "verify_ms": {"1": 10.0, "2": 12.0},
                "draft_ms_per_depth": 0.5,
                "overhead_ms": 0.2,
            },
            "contention": {"contended": False, "others_cpu_share": 0.0},
        }
    return {name: record for name in settings.prompt_sets}, measured


class ContendedThenQuietEvaluation:
    """:func:`fake_evaluate` whose first cost measurement is contended (others hold 60% of the CPU,
    so a 2-node verify reads 50 ms) and every later one quiet (12 ms); ``measured`` counts the
    measurements taken."""

    def __init__(self) -> None:
        self.measured = 0

    def __call__(self, export: str, settings, measure: bool = False):
        result, _ = fake_evaluate(export, settings)
        if not measure:
            return result, None
        self.measured += 1
        busy = self.measured == 1
        verify = 50.0 if busy else 12.0  # contended costs make a 2-node verify look dearer
        measured = {
            "costs": asdict(MachineCosts(10.0, {1: 10.0, 2: verify}, 0.5, 0.2)),
            "contention": {"contended": busy, "others_cpu_share": 0.6 if busy else 0.0},
        }
        return result, measured
