"""The loader choosing the lean decoder or the HF fallback; both implement the one runtime target
interface, :class:`draftsmith.runtime.target.interface.TargetDecoder`. Batch 1.

A folder's own Python code (``config.json`` ``auto_map`` for a model transformers does not know)
runs only when the caller passes ``trust_remote_code=True`` (the CLI's ``--trust-remote-code``);
otherwise the folder is refused in one line naming that flag
(:func:`~draftsmith.runtime.target.weights.check_custom_code`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from draftsmith.common.errors import InputError
from draftsmith.runtime.target.hf import HFModelAdapter
from draftsmith.runtime.target.interface import RuntimeCache, TargetDecoder
from draftsmith.runtime.target.model import LeanDecoder, UnsupportedArchitecture
from draftsmith.runtime.target.weights import check_custom_code, load_hf_config

BACKENDS = ("auto", "lean", "hf")
WeightTransform = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
__all__ = ["BACKENDS", "RuntimeCache", "TargetDecoder", "choose_decoder", "load_decoder"]


def load_decoder(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    backend: str = "auto",
    kernel_backend: str = "auto",
    linear_backend: str = "auto",
    transform_weights: WeightTransform | None = None,
    trust_remote_code: bool = False,
) -> TargetDecoder:
    """Load a runtime decoder: the lean one when the architecture is supported ("auto"), or force
    "lean" / "hf". ``linear_backend`` goes to :class:`LeanDecoder` (auto | cpp | mkldnn | dense);
    ``transform_weights`` rewrites the HF-named weights first (see
    :mod:`draftsmith.runtime.target.adapters`); ``trust_remote_code`` lets a folder's own model code
    run (off: such a folder is refused in one line)."""
    return choose_decoder(
        folder,
        dtype,
        device,
        backend,
        kernel_backend,
        linear_backend,
        transform_weights,
        trust_remote_code,
    )[0]


def choose_decoder(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    backend: str = "auto",
    kernel_backend: str = "auto",
    linear_backend: str = "auto",
    transform_weights: WeightTransform | None = None,
    trust_remote_code: bool = False,
) -> tuple[TargetDecoder, str, str]:
    """:func:`load_decoder` and what it chose: (decoder, "lean" | "hf", why). ``backend="lean"`` on
    a model the lean decoder lacks raises :class:`UnsupportedArchitecture` with one line naming the
    feature."""
    if backend not in BACKENDS:
        raise InputError(f"decoder backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    check_custom_code(folder, trust_remote_code)  # refused before anything else is read
    if backend == "hf":
        return (
            HFModelAdapter.from_pretrained(
                folder, dtype, device, transform_weights, trust_remote_code
            ),
            "hf",
            "forced by --backend hf",
        )
    missing = _lean_missing(folder)
    if missing is None:
        try:
            lean = LeanDecoder.from_pretrained(
                folder,
                dtype,
                device,
                kernel_backend=kernel_backend,
                linear_backend=linear_backend,
                transform_weights=transform_weights,
            )
        except UnsupportedArchitecture as err:
            missing = str(err)
        else:
            why = (
                "forced by --backend lean"
                if backend == "lean"
                else "auto: the lean decoder supports this model"
            )
            return lean, "lean", why
    if backend == "lean":
        raise UnsupportedArchitecture(f"--backend lean: {missing}")
    fallback = HFModelAdapter.from_pretrained(
        folder, dtype, device, transform_weights, trust_remote_code
    )
    return fallback, "hf", f"auto: the lean decoder cannot run it ({missing})"


def _lean_missing(folder: str | Path) -> str | None:
    """What the lean decoder lacks for this folder's model (``model_config.lean_support``; None =
    supported)."""
    from draftsmith.runtime.target.model_config import lean_support

    return lean_support(load_hf_config(folder))
