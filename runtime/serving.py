"""The runtime's entry: load a target and an export into a :class:`Runtime` (dtype choice, linear
backend, proposer, verifier, stop policy, optional adaptive-temperature controller; the last three
attached by runtime/attachments.py). Every command that serves starts here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from draftsmith import assets
from draftsmith.common.errors import InputError, InputNotFoundError
from draftsmith.export.format import read_config
from draftsmith.kernels import cpu_caps
from draftsmith.runtime.attachments import DrafterSettings, attach_exports
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.target.adapters import target_adapter
from draftsmith.runtime.target.interface import TargetDecoder
from draftsmith.runtime.target.loading import choose_decoder
from draftsmith.runtime.target.weights import check_custom_code, load_hf_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def eos_ids_from_folder(folder: str | Path) -> tuple[int, ...]:
    """The EOS ids HF ``generate`` would stop at: ``generation_config.json`` first, then
    ``config.json``."""
    for name in ("generation_config.json", "config.json"):
        path = Path(folder) / name
        if path.is_file():
            try:
                eos = json.loads(path.read_text()).get("eos_token_id")
            except json.JSONDecodeError as err:
                raise InputError(
                    f"{path} is not valid JSON (line {err.lineno}: {err.msg}): re-download or"
                    " re-save the target (save_pretrained)"
                ) from err
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()


@dataclass
class Runtime:
    """A loaded target (runtime decoder + tokenizer) and, optionally, a speculative decoder for an
    export."""

    folder: str
    model: TargetDecoder
    tokenizer: PreTrainedTokenizerBase
    eos_ids: tuple[int, ...]
    export_config: dict | None = None
    speculative: SpeculativeDecoder | None = None
    dtype_reason: str = ""
    # verifier / stop policy / proposer options that run, and their sources
    inference: dict[str, Any] | None = None
    decoder_backend: str = ""  # "lean" or "hf" (the transformers fallback)
    decoder_reason: str = ""  # why: forced by --backend, or what auto found
    # the user let the target folder's own model code run (--trust-remote-code)
    trust_remote_code: bool = False

    def backend_report(self) -> dict[str, Any]:
        """What runs and why: CPU, dtype, linear backend (for bench.json, the bench table and
        generate --verbose)."""
        plan = self.model.linear_plan
        return {
            "cpu": cpu_caps.probe().describe(),
            "dtype": str(self.model.dtype).replace("torch.", ""),
            "dtype_reason": self.dtype_reason,
            "linear_backend": plan.label if plan else "hf (transformers fallback)",
            "linear_reason": plan.reason if plan else self.decoder_reason,
            "decoder_backend": self.decoder_backend,
            "decoder_reason": self.decoder_reason,
            "kernels": self.model.kernel_backend,
            "device": str(self.model.device),
            "draft_plan": (
                self.speculative.proposer.draft_plan if self.speculative is not None else {}
            ),
        }


def parse_options(pairs: list[str] | None) -> dict[str, Any]:
    """``["depth=2", "policy=chain"]`` -> ``{"depth": 2, "policy": "chain"}`` (JSON values where
    they parse)."""
    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InputError(f"proposer option {pair!r} must look like key=value (e.g. depth=2)")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """``auto`` / ``fp32`` / ``bf16`` -> torch dtype for the runtime (see
    :func:`resolve_runtime_dtype`)."""
    return resolve_runtime_dtype(name, device)[0]


def resolve_runtime_dtype(name: str, device: str = "cpu") -> tuple[torch.dtype, str]:
    """The runtime's dtype and why. ``auto``: bf16 where the device computes it natively or the
    fused C++ layer runs (its AVX2 variant streams bf16 weights with fp32 math, so bf16 halves the
    bytes a step reads), else fp32.
    """
    if name != "auto" or torch.device(device).type != "cpu":
        return cpu_caps.resolve_dtype(name, device)
    from draftsmith.kernels import cpu_layer

    caps = cpu_caps.probe()
    if caps.native_bf16:
        return torch.bfloat16, f"auto -> bf16 (CPU has {caps.best_isa()})"
    reason = cpu_layer.why_unavailable()
    if reason is None:
        return (
            torch.bfloat16,
            (
                f"auto -> bf16 (no bf16 arithmetic, but the fused layer's {caps.cpu_layer_isa()} "
                "variant reads bf16 weights and computes in fp32)"
            ),
        )
    return torch.float32, f"auto -> fp32 (no bf16 instructions and no fused layer: {reason})"


def hf_fastest_dtype(device: str = "cpu") -> tuple[torch.dtype, str]:
    """The dtype HF ``generate`` runs fastest in on this device: bf16 where it is native, else fp32
    (HF's bf16 on a CPU without bf16 instructions is emulated and several times slower, so comparing
    against it is unfair).
    """
    return cpu_caps.resolve_dtype("auto", device)


def load_runtime(
    drafter: str | None,
    target: str | None,
    dtype: str = "fp32",
    kernels: str = "auto",
    verifier: str = "auto",
    temperature: float = 0.0,
    max_cache_len: int | None = None,
    proposer_options: dict[str, Any] | None = None,
    linear_backend: str = "auto",
    stop_policy: str | None = None,
    controller: str | None = None,
    backend: str = "auto",
    trust_remote_code: bool = False,
) -> Runtime:
    """Load the target (from ``target`` or the export's record) and the export's proposer, checking
    identity. ``backend`` picks the decoder (auto | lean | hf, see ``choose_decoder``);
    ``linear_backend`` how the lean decoder runs its linears (see
    ``draftsmith.runtime.target.linear_ops``); ``max_cache_len`` caps the speculative KV cache
    (None: sized from each request, as plain decoding sizes its own); ``trust_remote_code`` lets a
    target folder's own code run (off: such a folder is refused in one line naming
    ``--trust-remote-code``). Verifier, stop policy and proposer options: the flags where given,
    else the export's ``inference`` block (``runtime.inference`` records each choice and its source;
    see ``draftsmith.runtime.acceptance.choice``).
    ``trust_remote_code``: transformers' flag for the target's tokenizer and config, always passed
    (off by default), so transformers never asks on stdin."""
    # the export's; bench may tune it
    stop_policy = None if stop_policy in ("auto", "export") else stop_policy
    export_config = read_config(drafter) if drafter else None
    folder = _target_folder(target, export_config, controller, trust_remote_code)
    runtime, adapter = _load_target(
        folder, drafter, export_config, dtype, backend, kernels, linear_backend, trust_remote_code
    )
    settings = DrafterSettings(
        verifier, temperature, stop_policy, kernels, max_cache_len, proposer_options
    )
    attach_exports(runtime, drafter, controller, adapter, target or str(folder), settings)
    return runtime


def _target_folder(
    target: str | None, export_config: dict | None, controller: str | None, trust_remote_code: bool
) -> Path:
    """The target's folder: ``target``, else the one the drafter (or controller) was trained for,
    else the embedded default; a missing folder, a corrupt config.json or unrequested custom code
    is refused in one line."""
    if controller and not target and export_config is None:
        target = read_config(controller)["target"]["name_or_path"]
    name = target or (export_config["target"]["name_or_path"] if export_config else "smollm2-135m")
    folder = assets.resolve_target(name)
    if not Path(folder).is_dir():
        raise InputNotFoundError(
            f"target folder {folder} not found; pass --target PATH to the target the drafter "
            "was trained for"
        )
    load_hf_config(
        folder
    )  # a corrupt config.json is named here, not as transformers' bare JSON error
    check_custom_code(
        folder, trust_remote_code
    )  # a folder with its own code: refused in one line unless opted in
    return folder


def _load_target(
    folder: Path,
    drafter: str | None,
    export_config: dict | None,
    dtype: str,
    backend: str,
    kernels: str,
    linear_backend: str,
    trust_remote_code: bool,
) -> tuple[Runtime, tuple[Any, Any] | None]:
    """The runtime decoder and tokenizer of ``folder`` as a :class:`Runtime`, and the Medusa-2
    target adapter the drafter trained (None without one)."""
    from transformers import AutoTokenizer

    # transformers gets the user's choice itself (never whether the model needs code: a tokenizer's
    # own code is declared in tokenizer_config.json, which check_custom_code does not read)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    torch_dtype, dtype_reason = resolve_runtime_dtype(dtype)
    # Medusa-2: the target it trained
    adapter = target_adapter(drafter, export_config) if drafter else None
    model, decoder, why = choose_decoder(
        folder,
        torch_dtype,
        backend=backend,
        kernel_backend=kernels,
        linear_backend=linear_backend,
        transform_weights=adapter[0] if adapter else None,
        trust_remote_code=trust_remote_code,
    )
    runtime = Runtime(
        str(folder),
        model,
        tokenizer,
        eos_ids_from_folder(folder),
        export_config,
        dtype_reason=dtype_reason,
        decoder_backend=decoder,
        decoder_reason=why,
        trust_remote_code=trust_remote_code,
    )
    return runtime, adapter
