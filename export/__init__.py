"""Export format shared by training and the runtime: config.json + model.safetensors, target
identity, converters."""

from draftsmith.export.format import ExportError, TargetMismatchError, read_export, write_export
from draftsmith.export.identity import target_identity
from draftsmith.export.target_check import check_target

__all__ = [
    "ExportError",
    "TargetMismatchError",
    "check_target",
    "read_export",
    "target_identity",
    "write_export",
]
