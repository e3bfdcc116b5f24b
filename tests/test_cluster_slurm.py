"""``hydra/launcher=slurm``: Hydra's submitit launcher composes, and a sweep produces the sbatch
script we expect.

No SLURM here: ``sbatch`` and ``srun`` are fake executables on PATH. ``srun`` only has to exist
(submitit checks for it); ``sbatch`` copies the script submitit generated and refuses the job, so
the sweep stops right after the real launcher and the real submitit built it.
"""

from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.cli.train_command_line import check_launcher

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
        reason="hydra-submitit-launcher not installed (dev extra)",
    ),
]


def _executable(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_slurm_launcher_config_composes():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "recipe=eagle3",
            "hydra/launcher=slurm",
            "hydra.launcher.partition=gpu",
            "hydra.launcher.gpus_per_node=4",
            "--cfg",
            "hydra",
            "--package",
            "hydra.launcher",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "_target_: hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher" in out
    # Interpolations are resolved at submission (checked in the sbatch script below).
    for line in (
        "partition: gpu",
        "gpus_per_node: 4",
        "tasks_per_node: ${.gpus_per_node}",
        "signal_delay_s: 120",
        "signal: USR1@${..signal_delay_s}",
        "requeue: true",
        "max_num_timeout: 0",
    ):
        assert line in out, (line, out[-3000:])


def test_sweep_generates_one_sbatch_array_with_requeue_signal(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "srun", "exit 0\n")
    _executable(
        bin_dir / "sbatch",
        f'cp "$1" {tmp_path / "job.sh"}\necho "sbatch: error: fake cluster" >&2\nexit 1\n',
    )
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "-m",
            "recipe=eagle3",
            "trainer=fsdp",
            "trainer.num_nodes=2",
            "drafter.ttt_steps=2,3",
            "hydra/launcher=slurm",
            "hydra.launcher.partition=gpu",
            "hydra.launcher.gpus_per_node=4",
            "hydra.launcher.nodes=2",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (tmp_path / "job.sh").is_file(), proc.stderr[-3000:]
    script = (tmp_path / "job.sh").read_text()
    for flag in (
        "--nodes=2",
        "--gpus-per-node=4",
        "--ntasks-per-node=4",
        "--partition=gpu",
        "--time=1440",
        "--cpus-per-task=8",
        "--signal=USR1@120",
        "--requeue",
        "--open-mode=append",
        "--array=0-1%2",
    ):
        assert f"#SBATCH {flag}" in script, (flag, script)
    assert "USR2" not in script  # submitit's own signal is replaced by Lightning's requeue signal
    assert (
        "export OMP_NUM_THREADS=8" in script
        and "srun" in script
        and "submitit.core._submit" in script
    )
    assert proc.returncode != 0 and "fake cluster" in proc.stderr  # nothing ran


def test_missing_submitit_launcher_is_one_clear_error(monkeypatch):
    assert check_launcher(["-m", "recipe=eagle3", "hydra/launcher=slurm"]) is None  # installed here
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            None if name.startswith("hydra_plugins.hydra_submitit") else real(name, *a)
        ),
    )
    message = check_launcher(["-m", "recipe=eagle3", "hydra/launcher=slurm"])
    assert message is not None and "pip install hydra-submitit-launcher" in message
    assert check_launcher(["recipe=eagle3"]) is None  # not asked for: nothing to check
