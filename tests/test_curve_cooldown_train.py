"""A real learning curve with cooldown branches on a tiny target (``draftsmith train``
subprocesses): each branch's learning rate falls linearly from the stable value to exactly zero over
its steps, the main run stays at constant LR and its checkpoint is never written by a branch, and
both readings are evaluated in the runtime."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from pattern_target import write_heldout_prompts

from draftsmith.evals.curve_runner import run_curve
from draftsmith.evals.curve_training import subprocess_train
from draftsmith.evals.learning_curve import EvalSettings

pytestmark = pytest.mark.e2e


def _lr(path: Path) -> float:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    return float(ckpt["optimizer_states"][0]["param_groups"][0]["lr"])


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class LrRecordingTraining:
    """Runs ``draftsmith train`` as a subprocess, records the learning rate of every checkpoint
    each run wrote (``lrs[run][step]``), and checks that a branch leaves the main run's checkpoint
    at its branch point byte for byte as it found it."""

    def __init__(self, curve: Path) -> None:
        self.curve = curve
        self.lrs: dict[str, dict[int, float]] = {}

    def __call__(self, argv: list[str]) -> int:
        run = Path(next(a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")))
        branch = "branches" in run.parts
        if branch:  # the main run's checkpoint at the branch point, as the branch starts
            seed = self.curve / "run" / "checkpoints" / f"step{int(run.name[4:])}.ckpt"
            before = _digest(seed)
        code = subprocess_train(argv)
        self.lrs.setdefault(str(run), {}).update(
            {int(p.stem[4:]): _lr(p) for p in (run / "checkpoints").glob("step*.ckpt")}
        )
        if branch:  # ... and after it trained: the same bytes
            assert _digest(seed) == before, "the branch wrote the main run's checkpoint"
        return code


def _tiny_medusa(tiny_target_dir: Path, tiny_data_file: Path) -> list[str]:
    """A Medusa run on the tiny target that keeps a checkpoint at every step."""
    return [
        "recipe=medusa",
        f"target={tiny_target_dir}",
        "target.dtype=fp32",
        f"data={tiny_data_file}",
        "data.limit=null",
        "data.max_length=48",
        "data.batch_size=4",
        "data.val_fraction=0.1",
        "optim.warmup_steps=0",
        "run.checkpoint_every=1",
        "run.keep_checkpoints=50",
        "run.val_every=0",
        "trainer.log_every_n_steps=1",
    ]


def test_a_cooldown_branch_decays_to_zero_and_leaves_the_main_run_alone(
    tmp_path, tiny_target_dir, tiny_data_file
):
    runner = LrRecordingTraining(tmp_path)
    lrs = runner.lrs
    prompts = write_heldout_prompts(tmp_path / "heldout.jsonl", count=2)
    overrides = _tiny_medusa(tiny_target_dir, tiny_data_file)
    settings = EvalSettings(prompt_sets=(str(prompts),), prompts=2, max_new_tokens=8, dtype="fp32")
    curve = run_curve(tmp_path, overrides, [3, 6], settings, runner=runner, say=print, cooldown=0.5)

    base = lrs[str(tmp_path / "run")][3]
    assert base > 0 and all(
        v == pytest.approx(base) for v in lrs[str(tmp_path / "run")].values()
    )  # constant
    assert sorted(lrs[str(tmp_path / "run")]) == [1, 2, 3, 4, 5, 6]
    # the LR of the step after each checkpoint: the stable value at the branch point (the seed),
    # then linearly down to exactly 0 at the branch's last step
    assert [lrs[str(tmp_path / "branches" / "step3")][k] / base for k in (4, 5)] == pytest.approx(
        [0.5, 0]
    )
    assert [
        lrs[str(tmp_path / "branches" / "step6")][k] / base for k in (7, 8, 9)
    ] == pytest.approx([2 / 3, 1 / 3, 0], abs=1e-6)
    points = curve.data["points"]
    assert [p["cooled"]["steps"] for p in points] == [5, 9]
    # the branch trained on further batches
    assert points[0]["cooled"]["tokens"] > points[0]["tokens"]
    for p in points:
        name = str(prompts)
        assert 0 <= p["eval"][name]["first_position_acceptance"] <= 1
        assert 0 <= p["cooled"]["eval"][name]["first_position_acceptance"] <= 1
    assert not (tmp_path / "branches" / "step3" / "checkpoints").exists()
