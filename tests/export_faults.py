"""Helpers of the write-discipline, full-disk and export-identity tests: the CLI's one error line, a
run folder made from an export, a pid no process has, and a write that fills the disk part-way."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import torch

from draftsmith.cli import main
from draftsmith.distill.engine.exporting import DRAFTER_PREFIX
from draftsmith.export.format import read_export


def cli_error_line(capsys, argv: list[str]) -> str:
    """Run the CLI in-process; assert a non-zero exit with exactly one ``draftsmith ...`` error line
    and no traceback; return the line."""
    assert main(argv) != 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("draftsmith ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def run_folder_of(export_dir: Path, run_dir: Path) -> Path:
    """A run folder whose ``checkpoints/last.ckpt`` holds ``export_dir``'s weights, as training
    leaves it."""
    config, state = read_export(export_dir)
    export_config = {
        "method": config["method"],
        "architecture": dict(config["architecture"]),
        "inference": config.get("inference", {}),
    }
    (run_dir / "checkpoints").mkdir(parents=True)
    torch.save(
        {
            "state_dict": {DRAFTER_PREFIX + k: v for k, v in state.items()},
            "global_step": 3,
            "draftsmith": {"export_config": export_config, "target": config["target"]},
        },
        run_dir / "checkpoints" / "last.ckpt",
    )
    return run_dir


def dead_pid() -> int:
    """A pid no process has (above the kernel's pid_max, or the first free one below it)."""
    try:
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    except OSError:
        pid_max = 1 << 22
    pid = pid_max + 1
    while pid > 2:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1
    raise RuntimeError("no free pid found")


def fill_then_enospc(path: str | Path, nbytes: int = 4096) -> None:
    """Write ``nbytes`` to ``path`` and fail as a full disk does (what a monkeypatched writer
    calls)."""
    with open(path, "wb") as fh:
        fh.write(b"\0" * nbytes)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def relabel(export_dir: Path, out: Path, method: str, drop_identity: bool = False) -> Path:
    """A copy of ``export_dir`` whose config.json says ``method`` (and, with ``drop_identity``, has
    no recorded identity, as exports written before it existed)."""
    import shutil

    shutil.copytree(export_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["method"] = method
    if drop_identity:
        config.pop("identity", None)
    (out / "config.json").write_text(json.dumps(config))
    return out


def tree_snapshot(folder: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every file under ``folder`` (what a test checks was not
    touched)."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
