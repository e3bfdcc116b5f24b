"""The draftsmith export folder: ``config.json`` + named weight parts (``model.safetensors`` first), atomically.

Format v2 (v1 exports keep loading):
- ``parts``: named weight files. ``model`` (``model.safetensors``) is the trained module, as in v1; further parts
  sit beside it as ``<name>.safetensors`` (e.g. ``adapter`` for a LoRA applied to the target, Medusa-2).
- ``target.adapter``: when the export changes the target (a trained adapter), the identity names it, so the export
  is refused against the bare base target.
- ``base_export``: an optional reference to the export this one stacks on (a SpecDec++ head on an EAGLE drafter),
  with a fingerprint of the base's config and weights checked when it is resolved.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import draftsmith

FORMAT_NAME = "draftsmith"
FORMAT_VERSION = 2
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MAIN_PART = "model"
IDENTITY_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "fingerprint", "lm_head")
# Added after format_version 1 shipped: exports written before it lack the field, which is then not compared.
LATER_IDENTITY_FIELDS = ("lm_head",)


class ExportError(RuntimeError):
    """An export folder is missing, incomplete or corrupt."""


class TargetMismatchError(ExportError):
    """An export is being used with a target other than the one it was trained for."""


def atomic_folder_write(out_dir: str | Path, fill: Any) -> Path:
    """Create ``out_dir`` atomically: ``fill(tmp_dir)`` writes into a sibling temp folder that is renamed into place.

    An interrupted write leaves the previous ``out_dir`` (if any) untouched and no half-written folder under
    its name.
    """
    out = Path(out_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        fill(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _part_file(name: str) -> str:
    return WEIGHTS_FILE if name == MAIN_PART else f"{name}.safetensors"


def write_export(out_dir: str | Path, state_dict: dict[str, torch.Tensor], config: dict[str, Any],
                 parts: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """Write ``config.json`` (with format fields added), ``model.safetensors`` (``state_dict``) and one
    ``<name>.safetensors`` per extra part, atomically into ``out_dir``."""
    for key in ("method", "architecture", "target"):
        if key not in config:
            raise ValueError(f"export config lacks {key!r}")
    all_parts = {MAIN_PART: state_dict, **(parts or {})}
    bad = [n for n in all_parts if not n.replace("_", "").isalnum() or n.lower() != n]
    if bad:
        raise ValueError(f"weight part names must be lower-case letters, digits and '_': {bad}")
    tensors = {n: {k: v.detach().to("cpu").contiguous() for k, v in sd.items()} for n, sd in all_parts.items()}
    full = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "draftsmith_version": draftsmith.__version__,
            **config, "parts": {n: {"file": _part_file(n), "tensors": len(t)} for n, t in tensors.items()}}

    def fill(tmp: Path) -> None:
        for name, part in tensors.items():
            save_file(part, str(tmp / _part_file(name)), metadata={"format": "pt", "method": str(config["method"]),
                                                                   "part": name})
        (tmp / CONFIG_FILE).write_text(json.dumps(full, indent=2, sort_keys=False) + "\n")

    return atomic_folder_write(out_dir, fill)


def read_config(export_dir: str | Path) -> dict[str, Any]:
    """Read and validate an export's ``config.json``."""
    path = Path(export_dir)
    if path.is_file():
        hint = f" ({path.parent})" if path.name == CONFIG_FILE else ""
        raise ExportError(f"{path} is a file, not an export folder: pass the folder that holds config.json{hint}, "
                          "written by `draftsmith export` or by training (<run dir>/export)")
    if not path.is_dir():
        raise ExportError(f"export folder {path} does not exist; pass the folder written by `draftsmith export` "
                          "or by training (<run dir>/export)")
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise ExportError(f"{cfg_path} is missing: {path} is not a draftsmith export (or it is incomplete)")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as err:
        raise ExportError(f"{cfg_path} is not valid JSON ({err}); re-export the drafter") from err
    if config.get("format") != FORMAT_NAME:
        raise ExportError(f"{cfg_path} has format {config.get('format')!r}, expected {FORMAT_NAME!r}; "
                          "converted exports (medusa/speculators layouts) are for other engines")
    if int(config.get("format_version", 0)) > FORMAT_VERSION:
        raise ExportError(f"{cfg_path} has format_version {config['format_version']}; this draftsmith reads "
                          f"<= {FORMAT_VERSION}: upgrade draftsmith")
    for key in ("method", "architecture", "target"):
        if key not in config:
            raise ExportError(f"{cfg_path} lacks the {key!r} field; re-export the drafter")
    return config


def _load_part(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ExportError(f"{path} is missing; re-export the drafter")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ExportError(f"{path} is corrupt or truncated ({err}); re-export the drafter") from err


def read_export(export_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Return ``(config, state_dict)`` of an export folder's main part, with actionable errors for broken folders."""
    config = read_config(export_dir)
    return config, _load_part(Path(export_dir) / WEIGHTS_FILE)


def read_export_parts(export_dir: str | Path) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """``(config, {part name: state_dict})``; a v1 export has the one part ``model``."""
    config = read_config(export_dir)
    names = list((config.get("parts") or {MAIN_PART: {}}).keys())
    return config, {n: _load_part(Path(export_dir) / _part_file(n)) for n in names}


def export_fingerprint(export_dir: str | Path) -> str:
    """sha256 over an export's config.json and weight files: what a stacked export records of its base."""
    config = read_config(export_dir)
    digest = hashlib.sha256((Path(export_dir) / CONFIG_FILE).read_bytes())
    for name in (config.get("parts") or {MAIN_PART: {}}):
        with open(Path(export_dir) / _part_file(name), "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def base_reference(base_dir: str | Path) -> dict[str, Any]:
    """The ``base_export`` block for an export stacked on ``base_dir`` (e.g. a controller on a drafter)."""
    config = read_config(base_dir)
    return {"path": str(Path(base_dir).resolve()), "method": config["method"],
            "fingerprint": export_fingerprint(base_dir)}


def resolve_base_export(config: dict[str, Any], base_dir: str | Path | None = None) -> Path | None:
    """The folder of the export ``config`` stacks on (``base_dir`` overrides the recorded path when it moved), or
    None. Raises ExportError when it is missing or is no longer the export the stacked one was trained on."""
    ref = config.get("base_export")
    if not ref:
        return None
    path = Path(base_dir or ref["path"])
    if not path.is_dir():
        raise ExportError(f"this {config.get('method')} export stacks on {ref['method']} export {ref['path']}, which "
                          "does not exist here; pass its new location (--base-export PATH)")
    found = export_fingerprint(path)
    if found != ref["fingerprint"]:
        raise ExportError(f"{path} is not the {ref['method']} export this {config.get('method')} export was trained "
                          f"on (fingerprint {found[:19]}... vs recorded {ref['fingerprint'][:19]}...); use that export "
                          "or retrain on this one")
    return path


def check_target(config: dict[str, Any], identity: dict[str, Any], given: str | None = None) -> None:
    """Raise ``TargetMismatchError`` if ``identity`` is not the target recorded in ``config``.

    Only the fields ``identity`` carries are compared (a decoder without its tokenizer has no ``fingerprint``);
    fields added to the format later are skipped for exports that predate them. ``given`` names the target the
    user passed (folder or alias) for the message; default: ``identity["name_or_path"]``.
    """
    recorded = config.get("target", {})
    adapter = recorded.get("adapter")
    if adapter and (identity.get("adapter") or {}).get("fingerprint") != adapter.get("fingerprint"):
        raise TargetMismatchError(
            f"this {config.get('method')} export changes its target (a trained {adapter.get('kind', 'adapter')} "
            f"{adapter.get('fingerprint', '')[:19]}... ships as the export's 'adapter' part), but the target given "
            "does not carry it; load the target with the export's adapter applied")
    diffs = [f"{k}: export has {recorded.get(k)!r}, target has {identity[k]!r}"
             for k in IDENTITY_FIELDS if identity.get(k) is not None and recorded.get(k) != identity[k]
             and not (k in LATER_IDENTITY_FIELDS and recorded.get(k) is None)]
    if not diffs:
        return
    want = recorded.get("name_or_path")
    shown = given if given is not None else identity.get("name_or_path")
    if shown is None or str(shown) == str(want):  # the identity may carry the export's own name: never print it twice
        other = "the loaded target is a different model"
    else:
        other = f"the given target {str(shown)!r} is a different model"
    raise TargetMismatchError(
        f"this {config.get('method')} drafter was exported for target {want!r}, but {other} ("
        + "; ".join(diffs) + "). Use the target it was trained for, or retrain the drafter for this target.")
