"""``make gpu-train DRY_RUN=1``: every step of ``make gpu-train`` (prepare, part1, part2, receive)
rehearsed on the CPU with the same code and files (the real GGUF, real data) at tiny sizes, each
as its own process as the device commands are, so a lease is spent on the GPU, not on debugging."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gpu_check_core import REPO

GPU_TRAIN = Path(__file__).resolve().parent / "gpu_train.py"
# the CPU rehearsal's sizes for part1 and part2
TINY = [
    "--device",
    "cpu",
    "--tiny",
    "--max-length",
    "64",
    "--budgets",
    "128,256",
    "--steps",
    "2",
    "--warmup",
    "1",
]


def dry_run_steps(work: Path) -> list[list[str]]:
    """The four commands of a rehearsal in ``work``: prepare, part1, part2 and receive (with a
    bench)."""
    me = [sys.executable, str(GPU_TRAIN)]
    prepare = ["prepare", "--out", str(work / "parcels"), "--max-length", "64"]
    part1 = ["part1", "--parcels", str(work / "parcels" / "cmd1"), "--stash", str(work / "stash")]
    part2 = ["part2", "--parcels", str(work / "parcels" / "cmd2"), "--stash", str(work / "stash")]
    return [
        me + [*prepare, "--data-limit", "200", "--data-mib", "1"],
        me + [*part1, "--out-dir", str(work / "out1"), *TINY],
        me
        + [
            *part2,
            "--out-dir",
            str(work / "out2"),
            *TINY,
            "--tokens-per-step",
            "128",
            "--min-steps",
            "2",
            "--max-steps",
            "3",
            "--seconds",
            "900",
        ],
        me
        + [
            "receive",
            str(work / "out2" / "export"),
            "--out",
            str(work / "export"),
            "--bench",
            "--bench-prompts",
            "1",
            "--bench-tokens",
            "8",
        ],
    ]


def dry_run(args: argparse.Namespace) -> None:
    """Every step on the CPU with the same code and files, tiny sizes, each as its own process (as
    the commands are)."""
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-train-dry-"))
    for cmd in dry_run_steps(work):
        print(f"gpu-train dry run: {' '.join(cmd[2:])}", flush=True)
        subprocess.run(
            cmd,
            check=True,
            cwd=REPO,
            env={
                **os.environ,
                "DRAFTSMITH_CACHE": os.environ.get(
                    "DRAFTSMITH_CACHE", str(Path.home() / ".cache" / "draftsmith")
                ),
            },
        )
    print(f"gpu-train dry run: every step passed; files under {work}")
