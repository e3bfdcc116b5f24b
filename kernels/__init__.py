"""draftsmith.kernels: hot ops of the runtime, each with a plain-PyTorch reference and a Triton
kernel.

Exports are resolved lazily so that importing this package never imports triton (or even the op
modules).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "tree_attention": "draftsmith.kernels.attention",
    "compact_kv": "draftsmith.kernels.kv_compact",
    "greedy_verify": "draftsmith.kernels.verify",
    "BACKENDS": "draftsmith.kernels.dispatch",
    "KernelBackendError": "draftsmith.kernels.dispatch",
    "resolve_backend": "draftsmith.kernels.dispatch",
    "linear_cross_entropy": "draftsmith.kernels.linear_cross_entropy",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'draftsmith.kernels' has no attribute {name!r}")
