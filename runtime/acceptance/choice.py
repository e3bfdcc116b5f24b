"""What a speculative run uses — verifier, stop policy, proposer options — and where each came from.

The export's ``inference`` block holds the defaults its training chose (e.g. typical acceptance for a Medusa export
trained for it); a CLI flag overrides them; the bench records each choice with its source ("flag", "export" or
"default") so a reader of ``bench.json`` knows what ran.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from draftsmith.common.registry import Registry
from draftsmith.runtime.acceptance.stop_policies import ConfidenceStop, FixedDepth, StopPolicy
from draftsmith.runtime.acceptance.verifiers import GreedyVerifier, RejectionSamplingVerifier, TypicalVerifier

VerifierBuilder = Callable[[float, str, dict], Any]  # (temperature, kernels, export inference block) -> verifier
VERIFIERS: Registry[VerifierBuilder] = Registry("verifier")
register_verifier = VERIFIERS.register  # @register_verifier(name): what --verifier and inference.verifier say


@register_verifier("greedy")
def _greedy(temperature: float, kernels: str, inference: dict) -> Any:
    """Lossless at temperature 0: accept while the draft equals the target's argmax."""
    if temperature != 0:
        raise ValueError("the greedy verifier decodes at temperature 0; use --verifier rejection for sampling")
    return GreedyVerifier(kernels)


@register_verifier("rejection")
def _rejection(temperature: float, kernels: str, inference: dict) -> Any:
    """Lossless sampling: the output distribution is the target's at ``temperature``."""
    return RejectionSamplingVerifier(temperature=max(temperature, 1e-5))


@register_verifier("typical")
def _typical(temperature: float, kernels: str, inference: dict) -> Any:
    """Medusa's typical acceptance (lossy), thresholds from the export's ``inference.typical``."""
    typical = inference.get("typical", {})
    return TypicalVerifier(float(typical.get("posterior_threshold", 0.09)), float(typical.get("posterior_alpha", 0.3)),
                           temperature=max(temperature, 1e-5))


def _inference(export_config: dict | None) -> dict[str, Any]:
    return dict((export_config or {}).get("inference") or {})


def make_verifier(name: str, temperature: float, kernels: str, export_config: dict | None) -> Any:
    """The registered verifier ``name`` ("auto": greedy at T = 0, else rejection sampling)."""
    if name == "auto":
        name = "greedy" if temperature == 0 else "rejection"
    return VERIFIERS.get(name)(temperature, kernels, _inference(export_config))


def choose_verifier(flag: str, temperature: float, kernels: str, export_config: dict | None) -> tuple[Any, dict]:
    """The verifier and ``{"name", "source"}``. ``flag`` other than "auto" wins; else the export's
    ``inference.verifier`` (greedy there means "lossless", so it becomes rejection sampling at T > 0); else greedy at
    T = 0 and rejection sampling above."""
    if flag != "auto":
        name, source = flag, "flag"
    elif _inference(export_config).get("verifier") in VERIFIERS:
        name, source = _inference(export_config)["verifier"], "export"
        if name == "greedy" and temperature > 0:
            name = "rejection"  # the export's lossless choice, at the temperature asked for
    else:
        name, source = ("greedy" if temperature == 0 else "rejection"), "default"
    return make_verifier(name, temperature, kernels, export_config), {"name": name, "source": source}


def parse_stop_policy(spec: str | dict | None) -> StopPolicy | None:
    """``fixed:K`` | ``confidence:T`` (or ``confidence:T:K``) | ``none`` / ``fixed`` (the proposer's own depth), or an
    export's ``{"kind": ..., ...}`` dict -> a stop policy (None = the proposer's own depth)."""
    if spec is None:
        return None
    if isinstance(spec, dict):
        kind = str(spec.get("kind", "fixed"))
        args = [spec[k] for k in ("threshold", "max_depth") if k in spec] if kind == "confidence" else \
            [spec["max_depth"]] if "max_depth" in spec else []  # fmt: skip
    else:
        kind, *args = str(spec).split(":")
    try:
        if kind in ("none", "fixed") and not args:
            return None
        if kind == "fixed" and len(args) == 1:
            return FixedDepth(int(args[0]))
        if kind == "confidence" and len(args) in (1, 2):
            return ConfidenceStop(float(args[0]), *(int(a) for a in args[1:]))
    except ValueError:
        pass
    if kind == "learned":
        raise ValueError("a learned stop policy needs an acceptance-head export (SpecDec++), which this export is not")
    raise ValueError(f"stop policy {spec!r}: use fixed:K, confidence:THRESHOLD[:MAX_DEPTH] or none")


def choose_stop_policy(flag: str | None, export_config: dict | None) -> tuple[StopPolicy | None, dict]:
    """The stop policy and ``{"spec", "source"}``: the flag, else the export's ``inference.stop_policy``."""
    if flag not in (None, "auto"):
        return parse_stop_policy(flag), {"spec": flag, "source": "flag"}
    exported = _inference(export_config).get("stop_policy")
    if exported is not None:
        spec = exported if not isinstance(exported, dict) else ":".join(
            [str(exported.get("kind", "fixed"))] + [str(exported[k]) for k in ("threshold", "max_depth") if k in exported])
        return parse_stop_policy(exported), {"spec": spec, "source": "export"}
    return None, {"spec": "none", "source": "default"}


def option_sources(export_config: dict | None, flags: dict[str, Any] | None) -> dict[str, dict]:
    """Every proposer option in force with its source: the export's ``inference`` values (tree, depth, top_k, ...),
    each replaced by the flag's value where ``--proposer-option`` gave one."""
    exported = {k: v for k, v in _inference(export_config).items() if k not in ("verifier", "stop_policy", "typical")}
    out = {k: {"value": v, "source": "export"} for k, v in exported.items()}
    out.update({k: {"value": v, "source": "flag"} for k, v in (flags or {}).items()})
    return out
