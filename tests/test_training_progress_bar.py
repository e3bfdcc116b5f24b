"""The training progress bar: steps, tokens per second and an ETA (``trainer.max_time`` ending the
run first shortens it), from the fields and durations it prints to the bar the trainer installs,
on a fresh run and on one resumed mid-epoch."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from draftsmith.cli.training import compose_config

pytestmark = pytest.mark.unit


def test_progress_fields_show_steps_tokens_per_second_and_eta():
    from pytorch_lightning.callbacks import Timer

    from draftsmith.distill.engine.progress import format_duration, max_time_left, progress_fields

    assert progress_fields(12, 200, 0, 12_000, 10.0) == {
        "step": "12/200",
        "tok/s": "1,200",
        "eta": "2m37s",
    }
    assert progress_fields(50, 200, 50, 0, 0.0) == {
        "step": "50/200",
        "tok/s": "?",
        "eta": "?",
    }  # just resumed
    # trainer.max_time ends the run first: the ETA is the time it still allows, not the step count's
    # pace
    assert progress_fields(12, 100_000, 0, 12_000, 10.0, time_left=125.0)["eta"] == "2m05s"
    assert progress_fields(12, 200, 0, 12_000, 10.0, time_left=3600.0)["eta"] == "2m37s"
    assert [format_duration(s) for s in (5, 65, 7300)] == ["5s", "1m05s", "2h01m"]
    from draftsmith.common.durations import eta_seconds

    assert (
        eta_seconds(0, 10, 5.0) is None
        and eta_seconds(2, 10, 5.0) == 20.0
        and eta_seconds(10, 10, 9.0) == 0
    )
    assert max_time_left(SimpleNamespace(callbacks=[Timer(duration="00:00:10:00")])) == 600.0
    assert max_time_left(SimpleNamespace(callbacks=[])) is None


def bar_text(start: int, max_steps: int, reached: int, epoch_start: bool) -> str:
    """The step progress bar's text after one batch that took a run from step ``start`` to
    ``reached`` of ``max_steps`` (4,800 tokens seen), on a fake trainer."""
    from draftsmith.distill.engine.progress import StepProgressBar

    bar = StepProgressBar()
    fake = SimpleNamespace(
        global_step=start,
        max_steps=max_steps,
        world_size=1,
        loggers=[],
        callbacks=[],
        progress_bar_metrics={"train/loss": 3.25},
    )
    module = SimpleNamespace(tokens_seen=0)
    bar.on_train_start(fake, module)
    if epoch_start:
        bar.on_train_epoch_start(fake, module)
    fake.global_step, module.tokens_seen = reached, 4_800
    bar.on_train_batch_end(fake, module, None, None, 59)
    text = str(bar.train_progress_bar)
    bar.train_progress_bar.close()
    return text


def test_the_trainer_shows_the_step_progress_bar_with_steps_tokens_per_second_and_eta(tmp_path):
    from draftsmith.distill.engine.progress import StepProgressBar
    from draftsmith.distill.engine.trainer import build_trainer

    trainer = build_trainer(compose_config(["recipe=medusa"]), tmp_path)
    assert isinstance(trainer.progress_bar_callback, StepProgressBar)

    text = bar_text(0, 200, 12, epoch_start=True)
    assert text.startswith("step 12/200") and "6%" in text, text
    assert re.search(r"tok/s=[\d,]+", text) and re.search(r"eta=\d+(s|m\d\ds|h\d\dm)", text), text
    assert "train/loss=3.25" in text and "Epoch" not in text and "60/60" not in text, text
    # resumed mid-epoch: Lightning calls no epoch start (the bar read "0%" at 2537/4400)
    text = bar_text(2500, 4400, 2537, epoch_start=False)
    assert text.startswith("step 2537/4400") and "58%" in text, text
