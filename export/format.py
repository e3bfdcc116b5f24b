"""The draftsmith export folder: ``config.json`` + named weight parts (``model.safetensors`` first),
atomically.

Format v2 (v1 exports keep loading):
- ``parts``: named weight files. ``model`` (``model.safetensors``) is the trained module, as in v1;
  further parts sit beside it as ``<name>.safetensors`` (e.g. ``adapter`` for a LoRA applied to the
  target, Medusa-2).
- ``target.adapter``: when the export changes the target (a trained adapter), the identity names it,
  so the export is refused against the bare base target (export/target_check.py).
- ``base_export``: an optional reference to the export this one stacks on (a SpecDec++ head on an
  EAGLE drafter), with a fingerprint of the base's config and weights checked when it is resolved
  (export/stacking.py).

Reading checks the export's own identity digest first (export/integrity_check.py).
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import draftsmith
from draftsmith.common.atomic_folder import DiskFullError, OutputKind, OutputRefused, write_folder
from draftsmith.common.diffusion_format import DIFFUSION_KEY
from draftsmith.common.errors import DraftsmithError
from draftsmith.export.identity import export_digest

FORMAT_NAME = "draftsmith"
FORMAT_VERSION = 2
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MAIN_PART = "model"


class ExportError(DraftsmithError, RuntimeError):
    """An export folder is missing, incomplete or corrupt."""


class TargetMismatchError(ExportError):
    """An export is being used with a target other than the one it was trained for."""


class ExportSchemaError(ExportError, ValueError):
    """An export's config.json breaks its schema (export/schema.py): the message names the key."""


def is_export_output(folder: Path) -> bool:
    """True for a folder draftsmith's exporters write: a draftsmith export, a converted engine
    layout (its config.json carries a ``draftsmith`` block), a GGUF folder (``gguf.json``) or a
    block-diffusion model folder.
    """
    if (folder / "gguf.json").is_file():
        return True
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and (
        config.get("format") == FORMAT_NAME
        or isinstance(config.get("draftsmith"), dict)
        or DIFFUSION_KEY in config
    )


# Every file an exporter writes (draftsmith exports, engine layouts, GGUF folders, HF model folders
# with tokenizer).
EXPORT_OUTPUT = OutputKind(
    "export",
    is_export_output,
    (
        CONFIG_FILE,
        "*.safetensors",
        "*.safetensors.index.json",
        "gguf.json",
        "*.gguf",
        "lora/*",
        "generation_config.json",
        "tokenizer*",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.jinja",
        "vocab.json",
        "merges.txt",
    ),
)


class ExportDiskFullError(DiskFullError, ExportError):
    """The disk filled while an export folder was written: nothing replaced, the temporary folder
    removed."""


class ExportRefusedError(OutputRefused, ExportError):
    """``--out`` holds something draftsmith did not write, or the export being converted: nothing
    written."""


def atomic_folder_write(
    out_dir: str | Path, fill: Any, sources: tuple[Any, ...] = (), size_hint: int | None = None
) -> Path:
    """Create or replace the export folder ``out_dir`` atomically
    (:func:`draftsmith.common.atomic_folder.write_folder` with the ``export`` kind):
    ``fill(tmp_dir)`` writes a sibling temporary folder renamed into place when complete.

    Refused in one line (:class:`ExportRefusedError`): an ``out_dir`` that is not an export (the
    user's folder), an export holding files exporters never write, or one of ``sources`` (the export
    being converted). A full disk is :class:`ExportDiskFullError` (``size_hint``: bytes the folder
    needs). Either way the previous ``out_dir`` stays.
    """
    try:
        return write_folder(out_dir, fill, EXPORT_OUTPUT, sources=sources, size_hint=size_hint)
    except DiskFullError as err:
        raise ExportDiskFullError(errno.ENOSPC, str(err)) from err.__cause__
    except OutputRefused as err:
        raise ExportRefusedError(str(err)) from None


def tensor_bytes(parts: dict[str, dict[str, torch.Tensor]] | dict[str, torch.Tensor]) -> int:
    """Bytes of the tensors in a state dict, or in a dict of state dicts (a folder's size before it
    is written)."""
    return sum(
        tensor_bytes(v) if isinstance(v, dict) else v.numel() * v.element_size()
        for v in parts.values()
    )


def part_file(name: str) -> str:
    """The file a weight part is stored in, beside config.json: ``model.safetensors`` or
    ``<name>.safetensors``."""
    return WEIGHTS_FILE if name == MAIN_PART else f"{name}.safetensors"


def write_export(
    out_dir: str | Path,
    state_dict: dict[str, torch.Tensor],
    config: dict[str, Any],
    parts: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write ``config.json`` (with format fields added), ``model.safetensors`` (``state_dict``) and
    one ``<name>.safetensors`` per extra part, atomically into ``out_dir``."""
    for key in ("method", "architecture", "target"):
        if key not in config:
            raise ValueError(f"export config lacks {key!r}")
    all_parts = {MAIN_PART: state_dict, **(parts or {})}
    bad = [n for n in all_parts if not n.replace("_", "").isalnum() or n.lower() != n]
    if bad:
        raise ValueError(f"weight part names must be lower-case letters, digits and '_': {bad}")
    tensors = {
        n: {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
        for n, sd in all_parts.items()
    }
    shapes = {n: {k: list(v.shape) for k, v in t.items()} for n, t in tensors.items()}
    full = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "draftsmith_version": draftsmith.__version__,
        **config,
        "parts": {n: {"file": part_file(n), "tensors": len(t)} for n, t in tensors.items()},
        "identity": {
            "method": str(config["method"]),
            "digest": export_digest(config["method"], config["architecture"], shapes),
        },
    }

    def fill(tmp: Path) -> None:
        for name, part in tensors.items():
            save_file(
                part,
                str(tmp / part_file(name)),
                metadata={"format": "pt", "method": str(config["method"]), "part": name},
            )
        (tmp / CONFIG_FILE).write_text(json.dumps(full, indent=2, sort_keys=False) + "\n")

    return atomic_folder_write(out_dir, fill, size_hint=tensor_bytes(tensors))


def read_config(export_dir: str | Path) -> dict[str, Any]:
    """Read and validate an export's ``config.json``."""
    path = Path(export_dir)
    if path.is_file():
        hint = f" ({path.parent})" if path.name == CONFIG_FILE else ""
        raise ExportError(
            f"{path} is a file, not an export folder: pass the folder that holds config.json{hint},"
            " written by `draftsmith export` or by training (<run dir>/export)"
        )
    if not path.is_dir():
        raise ExportError(
            f"export folder {path} does not exist; pass the folder written by `draftsmith export` "
            "or by training (<run dir>/export)"
        )
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise ExportError(
            f"{cfg_path} is missing: {path} is not a draftsmith export (or it is incomplete)"
        )
    try:
        config = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExportError(f"{cfg_path} is not valid JSON ({err}); re-export the drafter") from err
    if not isinstance(config, dict) or config.get("format") != FORMAT_NAME:
        from draftsmith.export.folder_kinds import folder_kind

        found = folder_kind(path)
        if found.kind == "export":  # an export whose format field was edited
            raise ExportError(
                f"{cfg_path}: format must be {FORMAT_NAME!r}, got {config.get('format')!r}; restore"
                " the value the export was written with, or re-export the drafter"
            )
        raise ExportError(
            f"{path} is {found.label}, not a draftsmith export: pass the folder `draftsmith export`"
            " or training (<run dir>/export) wrote"
        )
    for key in ("method", "architecture", "target"):
        if key not in config:
            raise ExportError(f"{cfg_path} lacks the {key!r} field; re-export the drafter")
    from draftsmith.export.schema import validate_config

    validate_config(config, cfg_path)
    if config.get("format_version", 1) > FORMAT_VERSION:
        raise ExportError(
            f"{cfg_path} has format_version {config['format_version']}; this draftsmith reads "
            f"<= {FORMAT_VERSION}: upgrade draftsmith"
        )
    if isinstance(config["architecture"], dict):
        config["architecture"] = ArchitectureFields(config["architecture"], path, config)
    return config


class MissingArchitectureKey(ExportError, KeyError):
    """An architecture key the method needs is not in the export (an edited ``method``, another
    draftsmith's export). A KeyError too, so ``except KeyError`` keeps working; its text is the one
    line, not the bare key.
    """

    def __str__(self) -> str:
        return str(self.args[0])


class ArchitectureFields(dict):
    """An export's ``architecture`` block: a dict whose missing key is one line naming the export,
    the key and the fix (:class:`MissingArchitectureKey`), instead of ``KeyError: 'exit_layer'``
    from whichever reader asked.
    """

    def __init__(
        self, fields: dict[str, Any], export_dir: Path | None = None, config: dict | None = None
    ) -> None:
        super().__init__(fields)
        self.export_dir = export_dir
        self.method = (config or {}).get("method")
        self.written_as = ((config or {}).get("identity") or {}).get("method")

    def __missing__(self, key: str) -> Any:
        if self.written_as and self.written_as != self.method:
            why = (
                f"it was written as a {self.written_as!r} export and config.json's 'method' now"
                " says "
                f'{self.method!r}: restore "method": "{self.written_as}"'
            )
        else:
            why = (
                "if config.json's 'method' was edited, restore the method the export was written"
                " with; else re-export the drafter with this draftsmith"
            )
        raise MissingArchitectureKey(
            f"{self.export_dir}: a {self.method!r} export needs the architecture key "
            f"{key!r}, which its config.json lacks; {why}"
        )

    def __reduce__(
        self,
    ) -> tuple:  # copies and pickles are plain dicts: the export path stays out of them
        return dict, (dict(self),)


def refuse_non_finite(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Refuse (:class:`ExportError`) weights holding NaN or inf: served, they would draft nonsense
    without a word."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ExportError(
                f"{path}: {name} holds {bad} NaN/inf values (of {tensor.numel()}): the weights are "
                "damaged or the training diverged; export a checkpoint from before it, or retrain"
            )


def _load_part(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ExportError(f"{path} is missing; re-export the drafter")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ExportError(f"{path} is corrupt or truncated ({err}); re-export the drafter") from err
    refuse_non_finite(state, path)
    return state


def read_export(
    export_dir: str | Path, verify: bool = True
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Return ``(config, state_dict)`` of an export folder's main part, with actionable errors for
    broken folders; ``verify``: check the recorded identity first (export/integrity_check.py)."""
    from draftsmith.export.integrity_check import verify_identity  # it reads through this module

    config = read_config(export_dir)
    if verify:
        verify_identity(export_dir, config)
    return config, _load_part(Path(export_dir) / WEIGHTS_FILE)


def read_export_parts(
    export_dir: str | Path,
) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """``(config, {part name: state_dict})``, identity checked; a v1 export has the one part
    ``model``."""
    from draftsmith.export.integrity_check import verify_identity  # it reads through this module

    config = read_config(export_dir)
    verify_identity(export_dir, config)
    names = list((config.get("parts") or {MAIN_PART: {}}).keys())
    return config, {n: _load_part(Path(export_dir) / part_file(n)) for n in names}
