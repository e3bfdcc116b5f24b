"""Files that travel in parts: split with a SHA-256 per part and per file, checked and put back
together.

The lent GPU machine takes at most 64 MiB a command and gives back at most 8 files of 16 MiB, so the
94 MB target GGUF goes over in two commands and the trained export comes back in parts. A parcel is
a folder holding ``manifest.json`` (each file's size and hash, and its parts' names, sizes and
hashes) and the parts. Every step checks sizes and hashes and refuses a missing, truncated or
corrupt part with one line (:class:`ParcelError`); every output is written beside and renamed into
place, so an interrupted step is simply run again (a finished file whose hash matches is kept, a
half-written temporary is replaced).

    split_files({"model.gguf": path}, out, part_bytes)   # here: the parts and their manifest
    stash(parcel, "/tmp/gpu-train/parts")  # there, command 1: keep the parts it brought
    assemble(manifest, [stash, parcel], dest)            # there, command 2: the whole file, checked
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
CHUNK = 1 << 20


class ParcelError(RuntimeError):
    """A parcel cannot be used (a part missing, truncated or corrupt, a manifest unreadable): one
    line, nothing written over a good file."""


def sha256_of(path: Path) -> str:
    """SHA-256 of a file, streamed."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _replace_atomically(tmp: Path, dest: Path) -> None:
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, dest)


def split_file(
    src: Path, out_dir: Path, name: str, part_bytes: int, start_index: int = 0
) -> dict[str, Any]:
    """Write ``src`` into ``out_dir`` as ``<name>.partNN`` of at most ``part_bytes`` each; its
    manifest entry."""
    if part_bytes < 1:
        raise ValueError(f"part_bytes must be >= 1, got {part_bytes}")
    out_dir.mkdir(parents=True, exist_ok=True)
    parts, index = [], start_index
    with open(src, "rb") as handle:
        while block := handle.read(part_bytes):
            part = out_dir / f"{name}.part{index:02d}"
            tmp = part.with_name(f".{part.name}.tmp")
            tmp.write_bytes(block)
            _replace_atomically(tmp, part)
            parts.append(
                {
                    "file": part.name,
                    "bytes": len(block),
                    "sha256": hashlib.sha256(block).hexdigest(),
                }
            )
            index += 1
    return {"bytes": src.stat().st_size, "sha256": sha256_of(src), "parts": parts}


def split_across(src: Path, name: str, plan: list[tuple[Path, int | None]]) -> dict[str, Any]:
    """Write ``src`` as consecutive parts, part ``i`` of at most ``plan[i][1]`` bytes (None: the
    rest) into folder ``plan[i][0]`` (e.g. one folder per command that carries a share); parts that
    would be empty are not written. Returns its manifest entry."""
    parts, remaining = [], src.stat().st_size
    with open(src, "rb") as handle:
        for index, (folder, size) in enumerate(plan):
            block = handle.read(remaining if size is None else min(size, remaining))
            if not block:
                continue
            folder.mkdir(parents=True, exist_ok=True)
            part = folder / f"{name}.part{index:02d}"
            tmp = part.with_name(f".{part.name}.tmp")
            tmp.write_bytes(block)
            _replace_atomically(tmp, part)
            parts.append(
                {
                    "file": part.name,
                    "bytes": len(block),
                    "sha256": hashlib.sha256(block).hexdigest(),
                }
            )
            remaining -= len(block)
    if remaining:
        raise ParcelError(f"{src}: {remaining:,} bytes left over; the plan's parts are too small")
    return {"bytes": src.stat().st_size, "sha256": sha256_of(src), "parts": parts}


def write_manifest(out_dir: Path, files: dict[str, dict[str, Any]], **extra: Any) -> Path:
    """``manifest.json`` of a parcel (atomic)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"version": 1, "files": files, **extra}, indent=2) + "\n")
    _replace_atomically(tmp, out_dir / MANIFEST)
    return out_dir / MANIFEST


def split_files(
    sources: dict[str, Path], out_dir: Path, part_bytes: int, **extra: Any
) -> dict[str, Any]:
    """Split each of ``sources`` (name -> path) into ``out_dir`` and write the manifest; returns
    it."""
    files = {
        name: split_file(Path(path), out_dir, name, part_bytes) for name, path in sources.items()
    }
    write_manifest(out_dir, files, **extra)
    return read_manifest(out_dir)


def read_manifest(parcel: Path) -> dict[str, Any]:
    """The manifest of ``parcel`` (a folder or the manifest file itself)."""
    path = parcel / MANIFEST if parcel.is_dir() else parcel
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("version") != 1 or not isinstance(manifest.get("files"), dict):
            raise ValueError("not a version-1 parcel manifest")
    except (OSError, ValueError) as err:
        raise ParcelError(
            f"{path}: unreadable parcel manifest ({err}); copy the parcel again"
        ) from None
    return manifest


def check_part(path: Path, spec: dict[str, Any]) -> None:
    """Refuse a part that is missing, of the wrong size (truncated) or of the wrong content, in one
    line."""
    if not path.is_file():
        raise ParcelError(
            f"{path.name}: part missing (looked in {path.parent}); copy the parcel again"
        )
    size = path.stat().st_size
    if size != spec["bytes"]:
        raise ParcelError(
            f"{path}: {size:,} bytes, the manifest says {spec['bytes']:,} (a partial copy); "
            "copy it again"
        )
    if sha256_of(path) != spec["sha256"]:
        raise ParcelError(
            f"{path}: content differs from the manifest's SHA-256 (corrupt); copy it again"
        )


def find_part(name: str, folders: list[Path]) -> Path:
    """The first ``folders`` entry holding part ``name`` (else the first folder's would-be path)."""
    for folder in folders:
        if (folder / name).is_file():
            return folder / name
    return folders[0] / name


def stash(parcel: Path, into: Path) -> list[str]:
    """Copy the parts ``parcel`` holds (checked) and its manifest into ``into`` (outside the
    repository: it outlives this command); parts already there with the right hash are kept. Returns
    the part names now stashed.
    """
    manifest = read_manifest(parcel)
    into.mkdir(parents=True, exist_ok=True)
    kept = []
    for entry in manifest["files"].values():
        for spec in entry["parts"]:
            src, dest = parcel / spec["file"], into / spec["file"]
            if not src.is_file():
                continue  # another command brings this one
            check_part(src, spec)
            if not (
                dest.is_file()
                and dest.stat().st_size == spec["bytes"]
                and sha256_of(dest) == spec["sha256"]
            ):
                tmp = dest.with_name(f".{dest.name}.tmp")
                shutil.copyfile(src, tmp)
                _replace_atomically(tmp, dest)
            kept.append(spec["file"])
    shutil.copyfile(parcel / MANIFEST, into / f"{parcel.name}.{MANIFEST}")
    return kept


def assemble(manifest: dict[str, Any], name: str, folders: list[Path], dest: Path) -> Path:
    """Put file ``name`` back together at ``dest`` from its parts, found in ``folders``: every part
    checked first (one line naming the bad one), the whole checked against its hash, then renamed
    into place. A ``dest`` that already has the right size and hash is kept (a resumed step)."""
    entry = manifest["files"].get(name)
    if entry is None:
        raise ParcelError(
            f"the parcel holds no file {name!r} (it has {', '.join(sorted(manifest['files']))})"
        )
    if (
        dest.is_file()
        and dest.stat().st_size == entry["bytes"]
        and sha256_of(dest) == entry["sha256"]
    ):
        return dest
    parts = [find_part(spec["file"], folders) for spec in entry["parts"]]
    for path, spec in zip(parts, entry["parts"]):
        check_part(path, spec)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as out:
        for path in parts:
            with open(path, "rb") as handle:
                shutil.copyfileobj(handle, out, CHUNK)
    if tmp.stat().st_size != entry["bytes"] or sha256_of(tmp) != entry["sha256"]:
        tmp.unlink()
        raise ParcelError(
            f"{name}: the parts put together do not match the manifest's hash; copy the parcel"
            " again"
        )
    _replace_atomically(tmp, dest)
    return dest


def pack_folder(folder: Path, out_dir: Path, part_bytes: int, max_files: int) -> dict[str, Any]:
    """A parcel of every file of ``folder`` (flat) into ``out_dir`` with at most ``max_files`` files
    in all (the manifest counted); refused beforehand when the folder needs more."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    needed = 1 + sum(max(1, -(-p.stat().st_size // part_bytes)) for p in files)
    if needed > max_files:
        raise ParcelError(
            f"{folder} needs {needed} files of at most {part_bytes:,} bytes; only {max_files} can "
            "come back"
        )
    return split_files({p.name: p for p in files}, out_dir, part_bytes, folder=folder.name)


def unpack_folder(parcel: Path, dest: Path) -> Path:
    """Every file of ``parcel`` put back together into the folder ``dest`` (written beside, renamed
    into place; refuses a partial parcel in one line before anything is replaced)."""
    from draftsmith.common.atomic_folder import OutputKind, write_folder

    manifest = read_manifest(parcel)
    for entry in manifest["files"].values():  # all parts good before anything is written
        for spec in entry["parts"]:
            check_part(parcel / spec["file"], spec)
    kind = OutputKind("unpacked parcel", lambda f: any(f.iterdir()), tuple(manifest["files"]))

    def fill(tmp: Path) -> None:
        for name in manifest["files"]:
            assemble(manifest, name, [parcel], tmp / name)

    return write_folder(dest, fill, kind)
