"""Checkpoints that fit a quota, preemption (SIGUSR1 requeue under SLURM, SIGTERM), and resuming on
another world size with the same global batch."""

from __future__ import annotations

import logging
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from draftsmith.cli.training import compose_config
from draftsmith.common.errors import ConfigError
from draftsmith.distill.cluster.attempts import (
    keep_global_batch,
    rescale_loop_state,
    write_global_batch,
)
from draftsmith.distill.engine.checkpoints import (
    drop_stale_requeue_checkpoints,
    human_bytes,
    link_last,
)
from draftsmith.distill.engine.exporting import load_checkpoint
from draftsmith.distill.engine.resume_point import find_resume_checkpoint

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


def test_last_is_an_atomic_link_or_a_pointer_file(tmp_path, monkeypatch):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    for step in (2, 4):
        (ckpts / f"step{step}.ckpt").write_bytes(b"x" * step)
    assert link_last(ckpts / "step2.ckpt", ckpts / "last.ckpt") == "symlink"
    assert link_last(ckpts / "step4.ckpt", ckpts / "last.ckpt") == "symlink"  # replaced in place
    assert (ckpts / "last.ckpt").is_symlink() and os.readlink(ckpts / "last.ckpt") == "step4.ckpt"
    assert find_resume_checkpoint(tmp_path) == (ckpts / "step4.ckpt").resolve()
    assert not list(ckpts.glob(".last*"))  # no temporary left behind

    (
        ckpts / "last.ckpt"
    ).unlink()  # a kill between unlink and link of a naive relink: the newest step file wins
    assert find_resume_checkpoint(tmp_path) == ckpts / "step4.ckpt"

    def refuse(*_a, **_k):
        raise OSError("symlinks not supported here")

    monkeypatch.setattr(os, "symlink", refuse)
    assert link_last(ckpts / "step2.ckpt", ckpts / "last.ckpt") == "pointer"
    assert (ckpts / "last").read_text().strip() == "step2.ckpt" and not (
        ckpts / "last.ckpt"
    ).exists()
    assert find_resume_checkpoint(tmp_path) == (ckpts / "step2.ckpt").resolve()
    assert find_resume_checkpoint(tmp_path / "nothing") is None
    assert [human_bytes(n) for n in (999, 1_030_000_000)] == ["999 B", "1.03 GB"]


def test_newer_requeue_checkpoint_wins_and_stale_ones_are_dropped(tmp_path):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    (ckpts / "step2.ckpt").write_bytes(b"a")
    link_last(ckpts / "step2.ckpt", ckpts / "last.ckpt")
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    hpc.write_bytes(b"b")
    os.utime(ckpts / "step2.ckpt", (time.time() - 60, time.time() - 60))
    assert find_resume_checkpoint(tmp_path) == hpc
    deepspeed_style = tmp_path / "hpc_ckpt_2.ckpt"  # DeepSpeed writes checkpoint folders
    (deepspeed_style / "checkpoint").mkdir(parents=True)
    (deepspeed_style / "checkpoint" / "mp_rank_00_model_states.pt").write_bytes(b"d")
    (ckpts / "step6.ckpt").write_bytes(b"c")
    assert sorted(drop_stale_requeue_checkpoints(tmp_path, ckpts / "step6.ckpt")) == [
        hpc,
        deepspeed_style,
    ]
    assert not hpc.exists() and not deepspeed_style.exists()


def test_global_batch_is_kept_by_changing_accumulation(tmp_path, caplog):
    cfg = compose_config(
        ["recipe=medusa", "data.batch_size=2", "trainer.accumulate_grad_batches=1"]
    )
    previous = write_global_batch(tmp_path, world=2, batch_size=2, accumulate=1)
    assert previous["global_batch"] == 4
    with caplog.at_level("WARNING"):
        assert keep_global_batch(cfg, previous, world=1) == 2
    assert cfg.trainer.accumulate_grad_batches == 2
    assert "accumulate_grad_batches 1 -> 2 keeps the global batch of 4" in caplog.text
    assert keep_global_batch(cfg, previous, world=1) == 2  # already consistent: unchanged
    odd = compose_config(["recipe=medusa", "data.batch_size=3"])
    with pytest.raises(
        ConfigError, match="cannot keep the global batch 4 .* on 1 devices with data.batch_size=3"
    ):
        keep_global_batch(odd, previous, world=1)


def test_epoch_position_is_rescaled_to_the_new_accumulation():
    def ckpt(done, processed):
        counters = {
            "ready": processed,
            "started": processed,
            "processed": processed,
            "completed": processed - 1,
        }
        return {
            "loops": {
                "fit_loop": {
                    "state_dict": {"combined_loader": [{"batches_done_in_epoch": done}]},
                    "epoch_loop.batch_progress": {
                        "current": dict(counters),
                        "total": {k: v + 20 for k, v in counters.items()},
                    },
                }
            }
        }

    two_ranks = ckpt(
        done=3, processed=3
    )  # 2 processes x accumulation 1: 3 steps, 3 batches per rank
    assert rescale_loop_state(two_ranks, old_accumulate=1, new_accumulate=2) == 6
    loop = two_ranks["loops"]["fit_loop"]
    assert loop["state_dict"]["combined_loader"] == [{"batches_done_in_epoch": 6}]
    assert loop["epoch_loop.batch_progress"]["current"] == {
        "ready": 6,
        "started": 6,
        "processed": 6,
        "completed": 5,
    }
    assert loop["epoch_loop.batch_progress"]["total"]["processed"] == 26
    # SIGTERM between micro-batches (5 batches at accumulation 2 = 2 steps + 1): back to the step
    # boundary.
    mid = ckpt(done=4, processed=5)
    assert rescale_loop_state(mid, 2, 2) == 4
    assert mid["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"] == 4


def _fake_slurm(tmp_path: Path) -> dict[str, str]:
    """Environment of a 1-task SLURM job, with a fake ``scontrol`` that records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "draftsmith",
        "SLURM_NTASKS": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "localhost",
        "HYDRA_FULL_ERROR": "0",
    }


def _wait_for(predicate, what: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"train.py ended ({proc.returncode}) before {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _medusa_overrides(target: Path, data: Path, run_dir: Path) -> list[str]:
    """A one-head Medusa run on the tiny target that keeps only its newest checkpoint (every 2
    steps)."""
    return [
        "recipe=medusa",
        f"target={target}",
        "target.dtype=fp32",
        f"data={data}",
        "data.limit=null",
        "data.max_length=48",
        "data.batch_size=4",
        "data.val_fraction=0.1",
        "trainer.log_every_n_steps=1",
        "run.checkpoint_every=2",
        "run.keep_checkpoints=1",
        "run.final_eval_batches=0",
        "optim.warmup_steps=0",
        "heads.num_heads=1",
        f"hydra.run.dir={run_dir}",
    ]


def _signalled_attempt(
    tmp_path: Path, overrides: list[str], run_dir: Path, log_path: Path
) -> tuple[subprocess.Popen, float]:
    """train.py in a fake SLURM job: SIGUSR1 once it has checkpointed (it must requeue the job),
    then SIGTERM; the process (ended) and the seconds it took to stop after SIGTERM."""
    env = {**os.environ, **_fake_slurm(tmp_path)}
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *overrides, "trainer.max_steps=100000"],
            cwd=ROOT,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            last = run_dir / "checkpoints" / "last.ckpt"
            _wait_for(
                last.exists, "the first checkpoint", proc
            )  # the fit loop runs: signal handlers are set
            proc.send_signal(signal.SIGUSR1)  # SLURM's warning before the time limit
            hpc = run_dir / "hpc_ckpt_1.ckpt"
            # the requeue checkpoint; a fast run may supersede (and drop) it within one poll
            seen_hpc = []

            def requeued() -> bool:
                seen_hpc.append(hpc.exists())
                return (tmp_path / "scontrol.log").exists() and (
                    any(seen_hpc) or "Requeued SLURM job" in log_path.read_text()
                )

            _wait_for(requeued, "the requeue", proc)
            assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
            assert any(seen_hpc) or "Handling auto-requeue signal" in log_path.read_text()
            sent = time.time()
            proc.send_signal(signal.SIGTERM)  # SLURM's preemption / kill warning
            proc.wait(timeout=180)
            return proc, time.time() - sent
        finally:
            if proc.poll() is None:
                proc.kill()


def test_sigusr1_requeues_and_sigterm_checkpoints_then_the_next_attempt_resumes(
    tmp_path, tiny_target_dir, tiny_data_file, monkeypatch, caplog
):
    from draftsmith.distill.engine.trainer import train
    from draftsmith.recipes import get_recipe
    from draftsmith.train import expand_shorthands

    run_dir = tmp_path / "run"
    overrides = _medusa_overrides(tiny_target_dir, tiny_data_file, run_dir)
    log_path = tmp_path / "attempt1.log"
    proc, stopped_in = _signalled_attempt(tmp_path, overrides, run_dir, log_path)
    last, hpc = run_dir / "checkpoints" / "last.ckpt", run_dir / "hpc_ckpt_1.ckpt"
    text = log_path.read_text()
    assert proc.returncode == 143, text[-3000:]
    assert "SIGTERM: checkpoint" in text and "preempted by SIGTERM" in text, text[-3000:]
    assert stopped_in < 30  # one batch + one tiny checkpoint (generous: the CPU is shared)
    saved = load_checkpoint(run_dir)  # last.ckpt -> the SIGTERM checkpoint
    step = saved["global_step"]
    assert step > 2 and os.readlink(last) == f"step{step}.ckpt"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step*.ckpt")) == [
        f"step{step}.ckpt"
    ]  # keep 1
    assert re.search(
        r"checkpoint step\d+\.ckpt: [\d.]+ kB in [\d.]+s \(keeping the newest 1\)", text
    )  # size logged

    # The requeued attempt (in this process: no second interpreter start-up): the same config
    # resumes from the SIGTERM checkpoint, finishes with a final checkpoint and drops the stale
    # requeue file.
    for key, value in _fake_slurm(tmp_path / "again").items():
        monkeypatch.setenv(key, value)
    cfg = compose_config(
        expand_shorthands([o for o in overrides if not o.startswith("hydra.")])
        + [f"trainer.max_steps={step + 2}", "run.export=false"]
    )
    with caplog.at_level(logging.INFO):
        summary = train(cfg, get_recipe("medusa"), run_dir)
    assert summary["steps"] == step + 2
    assert f"resuming from {run_dir / 'checkpoints' / f'step{step}.ckpt'}" in caplog.text
    assert load_checkpoint(run_dir)["global_step"] == step + 2 and not hpc.exists()
    assert (
        torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["draftsmith_batch"][
            "world_size"
        ]
        == 1
    )
