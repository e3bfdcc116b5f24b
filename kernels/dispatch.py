"""Backend selection shared by every kernel op.

Each op in ``draftsmith.kernels`` has a plain-PyTorch reference and a Triton kernel. ``backend``
picks one:

- ``"auto"``: Triton when the tensors are on CUDA and triton imports, else the torch reference;
- ``"torch"``: always the reference;
- ``"triton"``: force the Triton kernel, error if triton is unavailable. Triton needs CUDA tensors,
  except under ``TRITON_INTERPRET=1`` where its interpreter runs kernels on CPU tensors (that is how
  the parity tests run it).

Triton itself is imported lazily, only inside the ``_triton_*`` modules.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from draftsmith.common.errors import DraftsmithError, InputError

BACKENDS = ("auto", "torch", "triton")


class KernelBackendError(DraftsmithError, RuntimeError):
    """The requested kernel backend cannot run here (triton missing, or tensors not on CUDA)."""


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether the ``triton`` package can be found (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpret() -> bool:
    """Whether triton's CPU interpreter is requested (env ``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """Return ``"torch"`` or ``"triton"`` for ``backend`` given the tensors an op runs on.

    Raises ValueError for an unknown backend name and KernelBackendError when ``"triton"`` is forced
    but cannot run.
    """
    if backend not in BACKENDS:
        raise InputError(
            f"unknown kernel backend {backend!r}; valid backends are {', '.join(BACKENDS)}"
        )
    on_cuda = all(t.is_cuda for t in tensors) and len(tensors) > 0
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if on_cuda and triton_available() else "torch"
    if not triton_available():
        raise KernelBackendError(
            "kernel backend 'triton' was requested but triton is not installed; "
            "install it (pip install triton) or use backend='torch'/'auto'"
        )
    if not on_cuda and not triton_interpret():
        raise KernelBackendError(
            "kernel backend 'triton' needs CUDA tensors (or env TRITON_INTERPRET=1 set before"
            " triton is imported to run its CPU interpreter); move the tensors to a GPU or use"
            " backend='torch'/'auto'"
        )
    return "triton"
