"""What a loaded :class:`~draftsmith.runtime.serving.Runtime` serves with beyond its target: an
export's proposer with its verifier and stop policy (the speculative decoder), and an
adaptive-temperature controller's per-position temperatures; each checked against the target's
identity first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from draftsmith.export.format import read_config
from draftsmith.export.identity import target_identity
from draftsmith.runtime.acceptance.choice import choose_stop_policy, choose_verifier, option_sources
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import NullProposer
from draftsmith.runtime.drafting.registry import build_proposer

if TYPE_CHECKING:
    from draftsmith.runtime.serving import Runtime


@dataclass(frozen=True)
class DrafterSettings:
    """The user's choices for a drafter's speculative decoder (``"auto"`` / None: the export's)."""

    verifier: str = "auto"
    temperature: float = 0.0
    stop_policy: str | None = None  # None: the export's
    kernels: str = "auto"
    max_cache_len: int | None = None
    proposer_options: dict[str, Any] | None = None


def attach_exports(
    runtime: Runtime,
    drafter: str | None,
    controller: str | None,
    adapter: tuple[Any, Any] | None,
    given: str,
    settings: DrafterSettings,
) -> None:
    """Attach the drafter's speculative decoder, then the controller, each checked against the
    target's identity (``adapter``: the Medusa-2 target adapter the drafter trained, if any)."""
    from transformers import AutoConfig

    if not (drafter or controller):
        return
    hf_config = AutoConfig.from_pretrained(
        runtime.folder, trust_remote_code=runtime.trust_remote_code
    )
    weight = runtime.model.lm_head_weight
    if drafter:
        identity = target_identity(
            runtime.export_config["target"]["name_or_path"], hf_config, runtime.tokenizer, weight
        )
        if adapter:
            identity = {**identity, "adapter": adapter[1]}
        attach_drafter(runtime, drafter, identity, given, settings)
    if controller:
        identity = target_identity(
            read_config(controller)["target"]["name_or_path"], hf_config, runtime.tokenizer, weight
        )
        attach_controller(
            runtime, controller, identity, given, settings.kernels, settings.max_cache_len
        )


def attach_drafter(
    runtime: Runtime, drafter: str, identity: dict, given: str, settings: DrafterSettings
) -> None:
    """The export's proposer (checked against the target's ``identity``), verifier and stop policy
    as the runtime's speculative decoder; ``runtime.inference`` records what runs and where each
    choice came from."""
    model, export_config = runtime.model, runtime.export_config
    verifier, temperature, kernels = settings.verifier, settings.temperature, settings.kernels
    proposer_options = settings.proposer_options
    # the HF fallback verifies trees exactly or refuses (one line), before any work
    model.check_speculative()
    proposer = build_proposer(
        drafter, model, identity=identity, given=given, **(proposer_options or {})
    )
    chosen_verifier, verifier_info = choose_verifier(verifier, temperature, kernels, export_config)
    policy, policy_info = choose_stop_policy(
        settings.stop_policy, export_config, export_dir=drafter
    )
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
        max_cache_len=settings.max_cache_len,
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
    from draftsmith.runtime.acceptance.rejection_sampling import RejectionSamplingVerifier

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
