"""Ctrl-C in training is an interruption, not a crash: the in-process run raises
``TrainingInterrupted`` naming the step and the last checkpoint (SIGINT works again afterwards),
and train.py prints where the checkpoint is and the command that resumes it, and exits 130 (Ctrl-C
while a checkpoint is written: test_resume_faults.py)."""

from __future__ import annotations

import re

import pytest
from test_training_refusals import error_lines, run_train_inprocess, tiny_overrides, train_main

from draftsmith.common.errors import TrainingInterrupted

pytestmark = pytest.mark.unit


def test_ctrl_c_in_training_names_the_checkpoint_and_the_resume_command(
    tmp_path, monkeypatch, tiny_target_dir, tiny_data_file
):
    from draftsmith.distill.engine.module import DistillModule

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    step = DistillModule.training_step

    def interrupted_at_3(self, batch, batch_idx):
        if self.global_step == 3:
            raise KeyboardInterrupt
        return step(self, batch, batch_idx)

    monkeypatch.setattr(DistillModule, "training_step", interrupted_at_3)
    overrides = [
        "recipe=medusa",
        *tiny_overrides(tiny_target_dir, tiny_data_file),
        "trainer.max_steps=10",
        "run.checkpoint_every=2",
    ]
    import signal

    with pytest.raises(TrainingInterrupted) as err:
        run_train_inprocess(overrides, tmp_path / "run")
    # Ctrl-C works again afterwards
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert err.value.step == 3 and err.value.checkpoint.endswith("step2.ckpt"), vars(err.value)
    assert isinstance(err.value, KeyboardInterrupt)


def test_train_py_reports_ctrl_c_with_exit_130(tmp_path, monkeypatch, capsys):
    from draftsmith.distill.engine import trainer

    ckpt = tmp_path / "checkpoints" / "step50.ckpt"

    def interrupted(*args, **kwargs):
        raise TrainingInterrupted(57, str(ckpt), str(tmp_path), 50)

    monkeypatch.setattr(trainer, "train", interrupted)
    assert (
        train_main(["recipe=medusa", "optim.lr=2e-3", "run.resume=false"], tmp_path, monkeypatch)
        == 130
    )
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert re.match(
        r"error: interrupted \(Ctrl-C\) at step 57; the last checkpoint is"
        rf" {re.escape(str(ckpt))}; "
        r"resume with: python \S*train\.py recipe=medusa optim\.lr=2e-3 hydra\.run\.dir=",
        lines[0],
    ), lines
    assert "run.resume=false" not in lines[0]

    def interrupted_early(*args, **kwargs):  # Ctrl-C before the first checkpoint (or while loading)
        raise TrainingInterrupted(3, None, str(tmp_path / "fresh"), 50)

    monkeypatch.setattr(trainer, "train", interrupted_early)
    assert train_main(["recipe=medusa"], tmp_path / "fresh", monkeypatch) == 130
    lines = error_lines(capsys.readouterr().err)
    assert (
        len(lines) == 1
        and "no checkpoint was written yet (the first comes after run.checkpoint_every=50 steps)"
        in lines[0]
    ), lines
    assert re.search(r"start again with: python \S*train\.py recipe=medusa", lines[0]), lines
    # DRAFTSMITH_DEBUG=1 keeps the traceback
    with pytest.raises(KeyboardInterrupt):
        train_main(
            ["recipe=medusa"], tmp_path / "fresh", monkeypatch, env={"DRAFTSMITH_DEBUG": "1"}
        )
