"""The runtime's entry: load a target and an export into a :class:`Runtime` (dtype choice, linear
backend, proposer, verifier, stop policy, optional adaptive-temperature controller). Every command
that serves starts here.
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
from draftsmith.export.identity import target_identity
from draftsmith.kernels import cpu_caps
from draftsmith.runtime.acceptance.choice import choose_stop_policy, choose_verifier, option_sources
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import NullProposer
from draftsmith.runtime.drafting.registry import build_proposer
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
    inference: dict[str, Any] | None = (
        None  # verifier / stop policy / proposer options that run, and their sources
    )
    decoder_backend: str = ""  # "lean" or "hf" (the transformers fallback)
    decoder_reason: str = ""  # why: forced by --backend, or what auto found
    trust_remote_code: bool = (
        False  # the user let the target folder's own model code run (--trust-remote-code)
    )

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
    from transformers import AutoConfig, AutoTokenizer

    stop_policy = (
        None if stop_policy in ("auto", "export") else stop_policy
    )  # the export's; bench may tune it
    export_config = read_config(drafter) if drafter else None
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
    # transformers gets the user's choice itself (never whether the model needs code: a tokenizer's
    # own code is declared in tokenizer_config.json, which check_custom_code does not read)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    torch_dtype, dtype_reason = resolve_runtime_dtype(dtype)
    adapter = (
        target_adapter(drafter, export_config) if drafter else None
    )  # Medusa-2: the target it trained
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
    hf_config = (
        AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        if drafter or controller
        else None
    )
    if drafter:
        identity = target_identity(
            export_config["target"]["name_or_path"], hf_config, tokenizer, model.lm_head_weight
        )
        if adapter:
            identity = {**identity, "adapter": adapter[1]}
        _attach_drafter(
            runtime,
            drafter,
            identity,
            target or str(folder),
            verifier,
            temperature,
            stop_policy,
            kernels,
            max_cache_len,
            proposer_options,
        )
    if controller:
        identity = target_identity(
            read_config(controller)["target"]["name_or_path"],
            hf_config,
            tokenizer,
            model.lm_head_weight,
        )
        attach_controller(
            runtime, controller, identity, target or str(folder), kernels, max_cache_len
        )
    return runtime


def _attach_drafter(
    runtime: Runtime,
    drafter: str,
    identity: dict,
    given: str,
    verifier: str,
    temperature: float,
    stop_policy: str | None,
    kernels: str,
    max_cache_len: int | None,
    proposer_options: dict[str, Any] | None,
) -> None:
    """The export's proposer (checked against the target's ``identity``), verifier and stop policy
    as the runtime's speculative decoder; ``runtime.inference`` records what runs and where each
    choice came from."""
    model, export_config = runtime.model, runtime.export_config
    # the HF fallback verifies trees exactly or refuses (one line), before any work
    model.check_speculative()
    proposer = build_proposer(
        drafter, model, identity=identity, given=given, **(proposer_options or {})
    )
    chosen_verifier, verifier_info = choose_verifier(verifier, temperature, kernels, export_config)
    policy, policy_info = choose_stop_policy(stop_policy, export_config, export_dir=drafter)
    runtime.inference = {
        "verifier": verifier_info,
        "stop_policy": policy_info,
        "proposer_options": option_sources(export_config, proposer_options),
    }
    verify_model = proposer.wrap_target(
        model
    )  # the target itself, or Kangaroo's cache-sharing wrapper
    runtime.speculative = SpeculativeDecoder(
        verify_model,
        proposer,
        chosen_verifier,
        stop_policy=policy,
        kernel_backend=kernels,
        max_cache_len=max_cache_len,
    )


def attach_controller(
    runtime: Runtime,
    controller: str,
    identity: dict,
    given: str,
    kernels: str = "auto",
    max_cache_len: int | None = None,
) -> None:
    """Sample with an adaptive-temperature export's per-position temperatures: with a drafter, its
    speculative loop verifies by rejection sampling at each node's temperature (the adaptive
    decoder's law exactly); without one, the same loop with the null proposer is the adaptive
    decoder alone. The controller must be for this target.
    """
    from draftsmith.controllers.adaptive_temperature import (
        AdaptiveTemperatureHead,
        TemperaturePolicy,
    )
    from draftsmith.export.target_check import check_target
    from draftsmith.runtime.acceptance.verifiers import RejectionSamplingVerifier

    head, config = AdaptiveTemperatureHead.from_export(controller)
    check_target(
        config, identity, given
    )  # a controller trained on another target's hidden states is refused
    head = head.to(device=runtime.model.device)
    policy = TemperaturePolicy(head, mode=(config.get("inference") or {}).get("choice", "greedy"))
    spec = runtime.speculative
    proposer = spec.proposer if spec is not None else NullProposer()
    runtime.speculative = SpeculativeDecoder(
        spec.model if spec is not None else runtime.model,
        proposer,
        RejectionSamplingVerifier(1.0),
        spec.stop_policy if spec else None,
        kernel_backend=kernels,
        max_cache_len=max_cache_len,
        temperature_policy=policy,
    )  # the policy itself: the loop calls its reset
    runtime.inference = {
        **(runtime.inference or {}),
        "controller": {
            "export": str(controller),
            "grid": list(head.config.grid),
            "granularity": policy.granularity,
        },
    }
