"""The draftsmith export folder: ``config.json`` + ``model.safetensors``, written atomically."""

from __future__ import annotations

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
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
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


def write_export(out_dir: str | Path, state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """Write ``config.json`` (with format fields added) and ``model.safetensors`` atomically into ``out_dir``."""
    for key in ("method", "architecture", "target"):
        if key not in config:
            raise ValueError(f"export config lacks {key!r}")
    full = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "draftsmith_version": draftsmith.__version__,
            **config}
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "method": str(config["method"])})
        (tmp / CONFIG_FILE).write_text(json.dumps(full, indent=2, sort_keys=False) + "\n")

    return atomic_folder_write(out_dir, fill)


def read_config(export_dir: str | Path) -> dict[str, Any]:
    """Read and validate an export's ``config.json``."""
    path = Path(export_dir)
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


def read_export(export_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Return ``(config, state_dict)`` of an export folder, with actionable errors for broken folders."""
    config = read_config(export_dir)
    weights = Path(export_dir) / WEIGHTS_FILE
    if not weights.is_file():
        raise ExportError(f"{weights} is missing; re-export the drafter")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as err:
        raise ExportError(f"{weights} is corrupt or truncated ({err}); re-export the drafter") from err
    return config, state


def check_target(config: dict[str, Any], identity: dict[str, Any], given: str | None = None) -> None:
    """Raise ``TargetMismatchError`` if ``identity`` is not the target recorded in ``config``.

    Only the fields ``identity`` carries are compared (a decoder without its tokenizer has no ``fingerprint``);
    fields added to the format later are skipped for exports that predate them. ``given`` names the target the
    user passed (folder or alias) for the message; default: ``identity["name_or_path"]``.
    """
    recorded = config.get("target", {})
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
