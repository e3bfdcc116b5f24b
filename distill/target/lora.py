"""Trainable LoRA adapters on the target (Medusa-2): the spec, which linears it adapts, and the
module that gathers the injected weights so a recipe's module can register (train, checkpoint,
export) them.

peft is an optional extra: :func:`require_peft` names it when missing. The injection itself is
:meth:`draftsmith.distill.target.frozen.Target.attach_lora`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from draftsmith.common.constants import ADAPTER_LORA
from draftsmith.common.errors import ConfigError
from draftsmith.export.adapter import PATH_SEP, adapter_fingerprint, module_key_to_part_key

PEFT_EXTRA = "pip install 'draftsmith[peft]' (or: pip install peft)"


def require_peft(what: str) -> Any:
    """The peft module, or a ConfigError naming the extra to install."""
    try:
        import peft
    except ImportError:
        raise ConfigError(
            f"{what} needs the peft package, which is not installed; install the extra: "
            f"{PEFT_EXTRA}"
        ) from None
    return peft


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter on the target: rank, alpha (scaling = alpha / rank), dropout, and which
    linears it adapts (a name matches a module whose path equals it or ends with ``.name``, as in
    peft)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self) -> None:
        if int(self.rank) < 1:
            raise ConfigError(f"LoRA rank must be >= 1, got {self.rank} (adapter.rank)")
        if float(self.alpha) <= 0:
            raise ConfigError(f"LoRA alpha must be > 0, got {self.alpha} (adapter.alpha)")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ConfigError(
                f"LoRA dropout must be in [0, 1), got {self.dropout} (adapter.dropout)"
            )
        if not self.target_modules:
            raise ConfigError(
                "adapter.target_modules is empty: name the target's linears to adapt, "
                "e.g. [q_proj, v_proj]"
            )

    @property
    def scaling(self) -> float:
        return float(self.alpha) / int(self.rank)


def lora_module_paths(model: nn.Module, target_modules: tuple[str, ...]) -> list[str]:
    """Paths of the linears of ``model`` that ``target_modules`` names; ConfigError listing what
    exists otherwise."""
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    paths = [n for n in linears if any(n == t or n.endswith("." + t) for t in target_modules)]
    if head is not None and any(model.get_submodule(p) is head for p in paths):
        raise ConfigError(
            "adapter.target_modules matches the LM head, which the export identity fingerprints; "
            "adapt the decoder layers' linears only"
        )
    unmatched = [t for t in target_modules if not any(n == t or n.endswith("." + t) for n in paths)]
    if unmatched:
        suffixes = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise ConfigError(
            f"adapter.target_modules {unmatched} match no linear layer of the target; its linears"
            f" are named {', '.join(suffixes)}"
        )
    return paths


class TargetAdapter(nn.Module):
    """The LoRA weights injected into a target, gathered under one module so an objective's module
    can register them (trained, checkpointed and exported with it). State-dict keys encode module
    paths with ``-`` for ``.``.
    """

    def __init__(self, spec: LoraSpec, layers: dict[str, tuple[nn.Module, nn.Module]]) -> None:
        super().__init__()
        self.spec = spec
        self.lora = nn.ModuleDict(
            {
                path.replace(".", PATH_SEP): nn.ModuleDict({"lora_A": a, "lora_B": b})
                for path, (a, b) in layers.items()
            }
        )
        self.requires_grad_(True)

    def part_state_dict(self) -> dict[str, torch.Tensor]:
        """The export's ``adapter`` part: ``<HF module path>.lora_A.weight`` /
        ``.lora_B.weight``."""
        return {module_key_to_part_key(k): v.detach() for k, v in self.lora.state_dict().items()}

    def fingerprint(self) -> str:
        """:func:`~draftsmith.export.adapter.adapter_fingerprint` of the current weights."""
        return adapter_fingerprint(self.part_state_dict())

    def config_block(self) -> dict[str, Any]:
        """What the runtime needs to apply the part (``inference.adapter`` of the export)."""
        return {
            "kind": ADAPTER_LORA,
            "part": "adapter",
            "rank": int(self.spec.rank),
            "alpha": float(self.spec.alpha),
            "scaling": self.spec.scaling,
            "target_modules": list(self.spec.target_modules),
        }
