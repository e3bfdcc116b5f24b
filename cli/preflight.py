"""Checks the serving and data commands run on their paths before anything loads: an export folder that is a file or a
target model, and an output folder that cannot be written. Each refusal is one line naming the input, the problem and
the fix (ranges of numeric flags are declared with the flags: :mod:`draftsmith.cli.arguments`)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from draftsmith.common.errors import InputError


def _export_problem(flag: str, given: str) -> str | None:
    """Why ``given`` cannot be the export folder ``flag`` asks for (a file, a target model folder), else None."""
    path = Path(given)
    if path.is_file():
        hint = f" ({path.parent})" if path.name == "config.json" else ""
        return f"{flag} {given} is a file, not an export folder: pass the folder that holds config.json{hint}"
    config = path / "config.json"
    if not config.is_file():
        return None  # missing folders and configs are named by the loader, with its own fix
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # a corrupt config.json: the loader names its line
    if isinstance(raw, dict) and "method" not in raw and ("model_type" in raw or "architectures" in raw):
        kind = raw.get("model_type") or (raw.get("architectures") or ["?"])[0]
        return (f"{flag} {given} is a target model folder ({kind}), not a draftsmith drafter export: pass it as "
                f"--target {given}, and {flag} the export a training run wrote (<run dir>/export, or `draftsmith "
                "export RUN --out DIR`)")
    return None


def refuse_bad_exports(args: argparse.Namespace) -> None:
    """Refuse, before any model loads, a ``--drafter`` / ``--controller`` that is a file or a target model folder."""
    for flag in ("--drafter", "--controller"):
        for given in filter(None, str(getattr(args, flag[2:], None) or "").split(",")):
            problem = _export_problem(flag, given)
            if problem:
                raise InputError(problem)


def check_writable_folder(out: str | Path, flag: str = "--out") -> Path:
    """Prove a file can be written in ``out`` (creating it and its parents for the probe, then removing what the
    probe created), so a bench that cannot save its results fails before it runs, not after. Returns the folder."""
    folder = Path(out).expanduser()
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{flag} {out} is a file, not a folder: nothing was run; pass a folder (it is created)")
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # the folders the probe creates (deepest first)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=".draftsmith-write-check-", dir=folder)
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        raise InputError(f"{flag} {out} cannot be written ({err.strerror or err}): nothing was run; pass a folder "
                         "you can write to") from None
    finally:
        for path in made:  # nothing left behind: a bench refused later writes no empty folder
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
    return folder


__all__ = ["check_writable_folder", "refuse_bad_exports"]
