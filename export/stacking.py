"""An export stacked on another (a SpecDec++ head or a controller on an EAGLE drafter): the
``base_export`` block it records of its base (path, method, a fingerprint of the base's config and
weights) and the check, when the stacked export is used, that the base is still the one it was
trained on.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from draftsmith.export.format import CONFIG_FILE, MAIN_PART, ExportError, part_file, read_config


def export_fingerprint(export_dir: str | Path) -> str:
    """sha256 over an export's config.json and weight files: what a stacked export records of its
    base."""
    config = read_config(export_dir)
    digest = hashlib.sha256((Path(export_dir) / CONFIG_FILE).read_bytes())
    for name in config.get("parts") or {MAIN_PART: {}}:
        with open(Path(export_dir) / part_file(name), "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def base_reference(base_dir: str | Path) -> dict[str, Any]:
    """The ``base_export`` block for an export stacked on ``base_dir`` (e.g. a controller on a
    drafter)."""
    config = read_config(base_dir)
    return {
        "path": str(Path(base_dir).resolve()),
        "method": config["method"],
        "fingerprint": export_fingerprint(base_dir),
    }


def resolve_base_export(config: dict[str, Any], base_dir: str | Path | None = None) -> Path | None:
    """The folder of the export ``config`` stacks on (``base_dir`` overrides the recorded path when
    it moved), or None. Raises ExportError when it is missing or is no longer the export the stacked
    one was trained on.
    """
    ref = config.get("base_export")
    if not ref:
        return None
    path = Path(base_dir or ref["path"])
    if not path.is_dir():
        raise ExportError(
            f"this {config.get('method')} export stacks on {ref['method']} export {ref['path']},"
            " which does not exist here; pass its new location (--base-export PATH)"
        )
    found = export_fingerprint(path)
    if found != ref["fingerprint"]:
        raise ExportError(
            f"{path} is not the {ref['method']} export this {config.get('method')} export was"
            f" trained on (fingerprint {found[:19]}... vs recorded {ref['fingerprint'][:19]}...);"
            " use that export or retrain on this one"
        )
    return path
