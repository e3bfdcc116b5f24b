"""Config groups several recipes share: the inference blocks of the tree-drafting families. Light
(no torch): the recipes' schemas import it before Hydra composes anything."""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.distill.config.keys import key


@dataclass
class TreeInferenceConfig:
    """A static/calibrated tree of head drafts (Medusa, Hydra, Clover); on 2 CPU cores trees above
    ~10-16 nodes get compute-bound."""

    tree_nodes: int = key("node budget of the draft tree", 12, ge=1)
    top_k: int = key("candidates per head", 10, ge=1)
    verifier: str = key(
        "greedy (lossless) | typical (Medusa's lossy rule) | rejection (lossless sampling)",
        "greedy",
        choices=("greedy", "typical", "rejection"),
    )
    posterior_threshold: float = key("typical acceptance: probability floor", 0.09, ge=0)
    posterior_alpha: float = key("typical acceptance: entropy-scaled floor", 0.3, ge=0)


@dataclass
class DynamicTreeInferenceConfig:
    """EAGLE-2's dynamic tree (EAGLE-1, EAGLE-3), sized for 2 CPU cores."""

    total_tokens: int = key("draft nodes verified per step", 16, ge=1)
    depth: int = key("draft steps per round", 4, ge=1)
    top_k: int = key("children expanded per frontier node", 4, ge=1)
    verifier: str = key(
        "greedy (lossless) | rejection (lossless sampling)",
        "greedy",
        choices=("greedy", "rejection"),
    )
