"""The setup steps of a fault case (case.py lists them), and the tmpfs mounts a case may ask for."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any


class Mounts:
    """tmpfs mounts made for one case, unmounted (lazily, so a busy one goes too) when the case
    ends."""

    def __init__(self) -> None:
        self.points: list[Path] = []

    def __enter__(self) -> Mounts:
        return self

    def __exit__(self, *exc: object) -> None:
        for point in reversed(self.points):
            subprocess.run(["umount", "-l", str(point)], capture_output=True)

    def mount(self, point: Path, options: str) -> str | None:
        """Mount a tmpfs at ``point``; the reason it cannot (not root, no mount) or None."""
        if os.geteuid() != 0 or shutil.which("mount") is None:
            return "needs root to mount a tmpfs"
        point.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            return f"mount failed: {done.stderr.strip()[:100]}"
        self.points.append(point)
        return None


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
    if value is None:
        tree.pop(last, None)
    else:
        tree[last] = value


def _nan(path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    save_file(
        {
            k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
            for k, v in tensors.items()
        },
        str(path),
        metadata={"format": "pt"},
    )


def _run(command: str, env: dict[str, str], root: Path, places: dict[str, str]) -> None:
    from run import argv_of

    done = subprocess.run(
        argv_of(command, places), cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"setup command failed ({done.returncode}): {command}\n{done.stderr[-1500:]}"
        )


def apply_setup(
    steps: tuple[tuple[Any, ...], ...],
    places: dict[str, str],
    mounts: Mounts,
    env: dict[str, str],
    root: Path,
) -> str | None:
    """Run ``steps`` (paths expanded); returns why the case must be skipped, else None."""
    from run import expand

    for kind, *args in steps:
        path = Path(expand(str(args[0]), places)) if args else None
        if kind in ("file", "bytes"):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(
                expand(args[1], places).encode() if kind == "file" else bytes.fromhex(args[1])
            )
        elif kind == "dir":
            path.mkdir(parents=True, exist_ok=True)
        elif kind == "copy":
            dst = Path(expand(args[1], places))
            dst.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, dst)
        elif kind == "json":
            tree = json.loads(path.read_text())
            for dotted, value in args[1].items():
                _set(tree, dotted, value)
            path.write_text(json.dumps(tree, indent=2))
        elif kind == "nan":
            _nan(path)
        elif kind == "truncate":
            path.write_bytes(path.read_bytes()[: int(args[1])])
        elif kind == "rm":
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        elif kind == "run":
            _run(args[0], env, root, places)
        elif kind == "ro":
            why = mounts.mount(path, "ro,size=64k")
            if why:
                return why
        elif kind == "full":
            why = mounts.mount(path, f"size={int(args[1])}k")
            if why:
                return why
        else:
            raise ValueError(f"unknown setup step {kind!r}")
    return None


__all__ = ["Mounts", "apply_setup"]
