"""Resumes that keep what they promise (issue 50): the CSV log appends across attempts, retention
counts the step files an earlier attempt wrote (in a moved run folder, with a changed
``run.checkpoint_every``), a damaged or missing checkpoint falls back to the newest intact one (or
says training restarts), and Ctrl-C while a checkpoint is being written is the interruption (the
previous checkpoint intact), not a crash. Tiny in-process target, in-process ``train``."""

from __future__ import annotations

import csv
import logging
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from draftsmith.cli.train_command_line import expand_shorthands
from draftsmith.cli.training import compose_config
from draftsmith.common.errors import TrainingInterrupted
from draftsmith.distill.engine import resume_point
from draftsmith.distill.engine.trainer import train
from draftsmith.recipes import get_recipe

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _data_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path_factory.getbasetemp() / "draftsmith-cache"))


def tiny_cfg(target: Path, data: Path, *extra: str):
    """A 1-head Medusa run on the tiny target: checkpoints every 2 steps, the newest 2 kept, no
    export."""
    return compose_config(
        expand_shorthands(
            [
                "recipe=medusa",
                f"target={target}",
                "target.dtype=fp32",
                f"data={data}",
                "data.limit=null",
                "data.max_length=48",
                "data.batch_size=4",
                "data.val_fraction=0.1",
                "trainer.max_steps=4",
                "trainer.log_every_n_steps=1",
                "run.checkpoint_every=2",
                "run.keep_checkpoints=2",
                "run.final_eval_batches=0",
                "optim.warmup_steps=0",
                "heads.num_heads=1",
                "run.export=false",
                *extra,
            ]
        )
    )


def step_files(run_dir: Path) -> list[str]:
    return sorted(
        (p.name for p in (run_dir / "checkpoints").glob("step*.ckpt")), key=lambda n: int(n[4:-5])
    )


def logged_steps(run_dir: Path) -> list[int]:
    with open(run_dir / "logs" / "metrics.csv", newline="") as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row.get("train/loss")]


def test_the_csv_log_keeps_every_attempt(tmp_path, tiny_target_dir, tiny_data_file):
    run_dir = tmp_path / "run"
    train(tiny_cfg(tiny_target_dir, tiny_data_file), get_recipe("medusa"), run_dir)
    assert logged_steps(run_dir) == [0, 1, 2, 3]
    # Raising max_steps resumes; a validation pass adds columns (the header is rewritten, no row is
    # lost).
    train(
        tiny_cfg(
            tiny_target_dir, tiny_data_file, "trainer.max_steps=6", "run.final_eval_batches=1"
        ),
        get_recipe("medusa"),
        run_dir,
    )
    assert logged_steps(run_dir) == [0, 1, 2, 3, 4, 5]
    header = (run_dir / "logs" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "val/loss" in header and "train/loss" in header
    assert not list((run_dir / "logs").glob(".*tmp*"))


def test_retention_counts_the_files_of_earlier_attempts(tmp_path, tiny_target_dir, tiny_data_file):
    first = tmp_path / "first"
    train(tiny_cfg(tiny_target_dir, tiny_data_file), get_recipe("medusa"), first)
    assert step_files(first) == ["step2.ckpt", "step4.ckpt"]
    moved = tmp_path / "moved"
    shutil.move(
        first, moved
    )  # Lightning's own record names the old folder: it used to keep only the new file
    train(
        tiny_cfg(tiny_target_dir, tiny_data_file, "trainer.max_steps=6"),
        get_recipe("medusa"),
        moved,
    )
    assert step_files(moved) == ["step4.ckpt", "step6.ckpt"]
    # A changed checkpoint schedule: Lightning does not restore its record at all.
    train(
        tiny_cfg(tiny_target_dir, tiny_data_file, "trainer.max_steps=9", "run.checkpoint_every=3"),
        get_recipe("medusa"),
        moved,
    )
    assert step_files(moved) == ["step6.ckpt", "step9.ckpt"]
    # Fewer kept from now on: the next save prunes to the new count.
    train(
        tiny_cfg(tiny_target_dir, tiny_data_file, "trainer.max_steps=10", "run.keep_checkpoints=1"),
        get_recipe("medusa"),
        moved,
    )
    assert step_files(moved) == ["step10.ckpt"]


def test_a_truncated_or_missing_newest_checkpoint_falls_back_with_one_warning(
    tmp_path, tiny_target_dir, tiny_data_file, caplog
):
    run_dir = tmp_path / "run"
    train(
        tiny_cfg(tiny_target_dir, tiny_data_file, "run.keep_checkpoints=3"),
        get_recipe("medusa"),
        run_dir,
    )
    folder = run_dir / "checkpoints"
    newest = folder / "step4.ckpt"
    assert (
        resume_point.checkpoint_problem(newest) is None
        and (folder / "last.ckpt").resolve() == newest
    )
    newest.write_bytes(
        newest.read_bytes()[: newest.stat().st_size // 2]
    )  # a copy that stopped half-way
    assert "truncated" in resume_point.checkpoint_problem(newest)
    with caplog.at_level(logging.WARNING):
        assert resume_point.resume_checkpoint(run_dir) == folder / "step2.ckpt"
    assert (
        f"{newest} cannot be resumed: it is truncated" in caplog.text
        and "resuming from" in caplog.text
    )
    with caplog.at_level(logging.INFO):
        summary = train(
            tiny_cfg(tiny_target_dir, tiny_data_file, "trainer.max_steps=5"),
            get_recipe("medusa"),
            run_dir,
        )
    assert summary["steps"] == 5 and f"resuming from {folder / 'step2.ckpt'}" in caplog.text
    # step 4 trained and written again
    assert resume_point.checkpoint_problem(folder / "step4.ckpt") is None

    (folder / "step5.ckpt").unlink()  # last.ckpt now names a file that was deleted
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert resume_point.resume_checkpoint(run_dir) == folder / "step4.ckpt"
    assert "names step5.ckpt, which is missing; resuming from" in caplog.text
    for path in folder.glob("step*.ckpt"):
        path.unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert resume_point.resume_checkpoint(run_dir) is None
    assert "training restarts from step 0" in caplog.text


def test_a_flipped_byte_is_a_damaged_checkpoint(tmp_path):
    path = tmp_path / "step2.ckpt"
    torch.save({"state_dict": {"w": torch.randn(256)}, "global_step": 2}, path)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "damaged" in resume_point.checkpoint_problem(path)
    assert resume_point.checkpoint_problem(tmp_path / "none.ckpt").startswith("it is missing")


def interrupting_save(monkeypatch, step_name: str, signals: int) -> None:
    """``torch.save`` whose write of ``step_name`` receives ``signals`` real SIGINTs part-way
    through its bytes (as Ctrl-C does while torch's C++ zip writer runs)."""
    real_save = torch.save

    class Interrupted:
        def __init__(self, handle):
            self.handle, self.sent = handle, 0

        def write(self, data):
            if self.sent < signals and self.handle.tell() > 0:
                self.sent += 1
                os.kill(os.getpid(), signal.SIGINT)
            return self.handle.write(data)

        def __getattr__(self, name):
            return getattr(self.handle, name)

    def save(obj, f, *args, **kwargs):
        if step_name in str(getattr(f, "name", f)):
            return real_save(obj, Interrupted(f), *args, **kwargs)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


@pytest.fixture()
def foreground_sigint():
    """Ctrl-C handled as in a foreground process: a test process started as a background job (or
    after a test that left Lightning's shutdown SIG_IGN) ignores SIGINT, and so would the run
    (deferred_sigint leaves an ignored SIGINT alone), so the injected signals would never arrive."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("signals", [1, 2], ids=["ctrl-c", "ctrl-c-twice"])
def test_ctrl_c_while_a_checkpoint_is_written_is_the_interruption(
    signals, tmp_path, tiny_target_dir, tiny_data_file, monkeypatch, foreground_sigint
):
    run_dir = tmp_path / "run"
    interrupting_save(monkeypatch, "step4", signals)
    with pytest.raises(
        TrainingInterrupted
    ) as stopped:  # was RuntimeError: [enforce fail at inline_container.cc]
        train(
            tiny_cfg(tiny_target_dir, tiny_data_file, "trainer.max_steps=6"),
            get_recipe("medusa"),
            run_dir,
        )
    folder = run_dir / "checkpoints"
    assert not list(folder.glob(".*tmp*"))  # no temporary left
    if signals == 1:  # the write was finished first, and is where the run resumes
        assert stopped.value.checkpoint == str((folder / "step4.ckpt").resolve())
        assert resume_point.checkpoint_problem(folder / "step4.ckpt") is None
    else:  # a second Ctrl-C abandons it: the previous checkpoint is intact and named
        assert stopped.value.checkpoint == str((folder / "step2.ckpt").resolve())
        assert step_files(run_dir) == ["step2.ckpt"]
    assert resume_point.checkpoint_problem(folder / "last.ckpt") is None
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_in_the_final_validation_is_the_interruption(
    tmp_path, tiny_target_dir, tiny_data_file, monkeypatch
):
    from draftsmith.distill.engine.module import DistillModule

    real = DistillModule.validation_step

    def interrupted(self, *args, **kwargs):
        if self.trainer.state.fn == "validate":  # the pass after fit, not a validation inside it
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DistillModule, "validation_step", interrupted)
    with pytest.raises(
        TrainingInterrupted
    ) as stopped:  # was SystemExit(1) from Lightning, no line, exit 1
        train(
            tiny_cfg(tiny_target_dir, tiny_data_file, "run.final_eval_batches=1"),
            get_recipe("medusa"),
            tmp_path / "run",
        )
    assert stopped.value.step == 4 and stopped.value.checkpoint.endswith("step4.ckpt")


def test_a_damaged_log_or_batch_record_never_stops_a_resume(
    tmp_path, tiny_target_dir, tiny_data_file, caplog
):
    run_dir = tmp_path / "run"
    train(
        tiny_cfg(tiny_target_dir, tiny_data_file, "trainer.max_steps=2"),
        get_recipe("medusa"),
        run_dir,
    )
    log_file = run_dir / "logs" / "metrics.csv"
    garbage = bytes(range(256)) * 4
    log_file.write_bytes(
        garbage
    )  # not a CSV: used to be a UnicodeDecodeError traceback at the logger's start
    (run_dir / "checkpoints" / "global_batch.json").write_text(
        "{cut"
    )  # used to be a JSONDecodeError traceback
    with caplog.at_level(logging.WARNING):
        train(
            tiny_cfg(tiny_target_dir, tiny_data_file, "trainer.max_steps=3"),
            get_recipe("medusa"),
            run_dir,
        )
    aside = [p for p in log_file.parent.iterdir() if p.name.startswith("metrics.csv.unreadable-")]
    assert len(aside) == 1 and aside[0].read_bytes() == garbage and logged_steps(run_dir) == [2]
    assert "is not a CSV log" in caplog.text and "global_batch.json is unreadable" in caplog.text
    with log_file.open("a") as handle:  # a row a kill -9 cut before its newline
        handle.write("0,99")
    train(
        tiny_cfg(tiny_target_dir, tiny_data_file, "trainer.max_steps=4"),
        get_recipe("medusa"),
        run_dir,
    )
    assert logged_steps(run_dir) == [2, 3] and "\n0,99\n" in log_file.read_text()


def test_an_unreadable_last_pointer_falls_back_to_the_step_files(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"global_step": 2}, folder / "step2.ckpt")
    (folder / "last").write_bytes(b"\xff\xfe\x00")
    assert resume_point.resume_checkpoint(tmp_path) == folder / "step2.ckpt"
