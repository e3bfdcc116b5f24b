"""What a speculative run uses — verifier, stop policy, proposer options — and where each came from.

The export's ``inference`` block holds the defaults its training chose (e.g. typical acceptance for
a Medusa export trained for it); a CLI flag overrides them; the bench records each choice with its
source ("flag", "export" or "default") so a reader of ``bench.json`` knows what ran.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from draftsmith.common.constants import STOP_CONFIDENCE, STOP_FIXED, STOP_LEARNED
from draftsmith.common.errors import InputError
from draftsmith.common.registry import Registry
from draftsmith.runtime.acceptance.rejection_sampling import RejectionSamplingVerifier
from draftsmith.runtime.acceptance.stop_policies import (
    ConfidenceStop,
    FixedDepth,
    LearnedStop,
    ProposerHead,
    StopPolicy,
)
from draftsmith.runtime.acceptance.verifiers import GreedyVerifier, TypicalVerifier, Verifier

VerifierBuilder = Callable[
    [float, str, dict], Verifier
]  # (temperature, kernels, export inference block) -> verifier
VERIFIERS: Registry[VerifierBuilder] = Registry("verifier")
# @register_verifier(name): what --verifier and inference.verifier say
register_verifier = VERIFIERS.register


@register_verifier("greedy")
def _greedy(temperature: float, kernels: str, inference: dict) -> Verifier:
    """Lossless at temperature 0: accept while the draft equals the target's argmax."""
    if temperature != 0:
        raise InputError(
            "the greedy verifier decodes at temperature 0; use --verifier rejection for sampling"
        )
    return GreedyVerifier(kernels)


@register_verifier("rejection")
def _rejection(temperature: float, kernels: str, inference: dict) -> Verifier:
    """Lossless sampling: the output distribution is the target's at ``temperature``."""
    return RejectionSamplingVerifier(temperature=max(temperature, 1e-5))


@register_verifier("typical")
def _typical(temperature: float, kernels: str, inference: dict) -> Verifier:
    """Medusa's typical acceptance (lossy), thresholds from the export's ``inference.typical``."""
    typical = inference.get("typical", {})
    return TypicalVerifier(
        float(typical.get("posterior_threshold", 0.09)),
        float(typical.get("posterior_alpha", 0.3)),
        temperature=max(temperature, 1e-5),
    )


def _inference(export_config: dict | None) -> dict[str, Any]:
    return dict((export_config or {}).get("inference") or {})


def make_verifier(
    name: str, temperature: float, kernels: str, export_config: dict | None
) -> Verifier:
    """The registered verifier ``name`` ("auto": greedy at T = 0, else rejection sampling)."""
    if name == "auto":
        name = "greedy" if temperature == 0 else "rejection"
    return VERIFIERS.get(name)(temperature, kernels, _inference(export_config))


def choose_verifier(
    flag: str, temperature: float, kernels: str, export_config: dict | None
) -> tuple[Verifier, dict]:
    """The verifier and ``{"name", "source"}``. ``flag`` other than "auto" wins; else the export's
    ``inference.verifier`` (greedy there means "lossless", so it becomes rejection sampling at T >
    0); else greedy at T = 0 and rejection sampling above."""
    if flag != "auto":
        name, source = flag, "flag"
    elif _inference(export_config).get("verifier") in VERIFIERS:
        name, source = _inference(export_config)["verifier"], "export"
        if name == "greedy" and temperature > 0:
            name = "rejection"  # the export's lossless choice, at the temperature asked for
    else:
        name, source = ("greedy" if temperature == 0 else "rejection"), "default"
    return make_verifier(name, temperature, kernels, export_config), {
        "name": name,
        "source": source,
    }


STOP_POLICY_FORMS = (
    "fixed:K, confidence:THRESHOLD[:MAX_DEPTH], learned:H[:MIN_DEPTH:MAX_DEPTH] or none"
)
_DICT_FIELDS = {
    STOP_FIXED: ("max_depth",),
    STOP_CONFIDENCE: ("threshold", "max_depth"),
    STOP_LEARNED: ("threshold", "min_depth", "max_depth"),
}


def _threshold(kind: str, value: float | str) -> float:
    """A stop threshold from user input: a number strictly inside (0, 1)."""
    t = float(value)
    if not 0.0 < t < 1.0:
        what = (
            "P(some drafted token is rejected)"
            if kind == "learned"
            else "the drafter's probability"
        )
        raise InputError(
            f"{kind} stop threshold {value} is outside (0, 1): it bounds {what}; e.g. {kind}:0.3"
        )
    return t


def parse_stop_policy(
    spec: str | dict | None, head: torch.nn.Module | None = None
) -> StopPolicy | None:
    """``fixed:K`` | ``confidence:T`` (or ``confidence:T:K``) | ``learned:H`` (or
    ``learned:H:MIN:MAX``, SpecDec++'s rule, with ``head`` the export's acceptance head) | ``none``
    / ``fixed`` (the proposer's own depth), or an export's ``{"kind": ..., ...}`` dict -> a stop
    policy (None = the proposer's own depth). Thresholds must lie in (0, 1).
    """
    if spec is None:
        return None
    if isinstance(spec, dict):
        kind = str(spec.get("kind", "fixed"))
        args = [spec[k] for k in _DICT_FIELDS.get(kind, ()) if k in spec]
    else:
        kind, *args = str(spec).split(":")
    try:
        if kind in ("none", "fixed") and not args:
            return None
        if kind == STOP_FIXED and len(args) == 1:
            return FixedDepth(int(args[0]))
        if kind == STOP_CONFIDENCE and len(args) in (1, 2):
            return ConfidenceStop(_threshold(kind, args[0]), *(int(a) for a in args[1:]))
        if kind == STOP_LEARNED and len(args) in (1, 3):
            threshold = _threshold(kind, args[0])
            if head is None:
                raise LookupError
            depths = [int(a) for a in args[1:]]
            if depths and not 1 <= depths[0] <= depths[1]:
                raise InputError(f"learned stop policy {spec!r}: need 1 <= MIN_DEPTH <= MAX_DEPTH")
            return LearnedStop(
                head, threshold, *(depths[::-1])
            )  # (threshold, max_depth, min_depth)
    except LookupError:
        raise InputError(
            "a learned stop policy needs an acceptance head (a SpecDec++ export, method"
            " 'specdecpp', or a DFlash export with a confidence head), which this export is not;"
            " train one with `python train.py recipe=specdecpp drafter=EXPORT_DIR`, or use fixed:K"
            " / confidence:THRESHOLD"
        ) from None
    except ValueError as err:
        if "outside (0, 1)" in str(err) or "MIN_DEPTH" in str(err):
            raise
    raise InputError(f"stop policy {spec!r}: use {STOP_POLICY_FORMS}")


def learned_head(
    export_dir: str | Path | None, export_config: dict | None
) -> torch.nn.Module | None:
    """The acceptance head of a SpecDec++ export (None for any other export)."""
    if export_dir is None or (export_config or {}).get("method") != "specdecpp":
        return None
    from draftsmith.controllers.acceptance import AcceptanceHead

    return AcceptanceHead.from_export(export_dir)[0]


def _proposer_carries_head(export_config: dict | None) -> bool:
    """Whether the export's proposer binds an acceptance head itself: SpecDec++'s, or DFlash's
    confidence head (seen as a rejection head). A DFlash export trained without one gets a clear
    error naming the option.
    """
    config = export_config or {}
    if config.get("method") == "specdecpp":
        return True
    if config.get("method") != "dflash":
        return False
    if not (config.get("architecture") or {}).get("confidence_head"):
        raise InputError(
            "a learned stop policy on a DFlash export reads its confidence head, and this export"
            " was trained without one: retrain with drafter.confidence_head=true, or use fixed:K /"
            " confidence:THRESHOLD"
        )
    return True


def _spec_string(exported: str | dict) -> str:
    if not isinstance(exported, dict):
        return str(exported)
    kind = str(exported.get("kind", "fixed"))
    return ":".join(
        [kind] + [str(exported[k]) for k in _DICT_FIELDS.get(kind, ()) if k in exported]
    )


def choose_stop_policy(
    flag: str | None, export_config: dict | None, export_dir: str | Path | None = None
) -> tuple[StopPolicy | None, dict]:
    """The stop policy and ``{"spec", "source"}``: the flag, else the export's
    ``inference.stop_policy``. ``export_dir`` (the export folder) lets ``learned`` load a SpecDec++
    export's acceptance head.
    """
    needs_head = any(
        str(s).startswith("learned") or (isinstance(s, dict) and s.get("kind") == STOP_LEARNED)
        for s in (flag, _inference(export_config).get("stop_policy"))
    )
    head = learned_head(export_dir, export_config) if needs_head else None
    if needs_head and head is None and _proposer_carries_head(export_config):
        head = ProposerHead()  # the proposer carries the head and binds it before drafting
    if flag not in (None, "auto"):
        return parse_stop_policy(flag, head), {"spec": flag, "source": "flag"}
    exported = _inference(export_config).get("stop_policy")
    if exported is not None:
        return parse_stop_policy(exported, head), {
            "spec": _spec_string(exported),
            "source": "export",
        }
    return None, {"spec": "none", "source": "default"}


def option_sources(export_config: dict | None, flags: dict[str, Any] | None) -> dict[str, dict]:
    """Every proposer option in force with its source: the export's ``inference`` values (tree,
    depth, top_k, ...), each replaced by the flag's value where ``--proposer-option`` gave one."""
    exported = {
        k: v
        for k, v in _inference(export_config).items()
        if k not in ("verifier", "stop_policy", "typical")
    }
    out = {k: {"value": v, "source": "export"} for k, v in exported.items()}
    out.update({k: {"value": v, "source": "flag"} for k, v in (flags or {}).items()})
    return out
