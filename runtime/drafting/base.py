"""The proposer protocol, the step context handed to it, and one registry that discovers proposer families.

Every module of this package except ``base`` and ``tree`` is a family: importing it registers its builders
(``@register_proposer(method)``), so adding a family adds a file and no line to any list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from draftsmith.common.registry import Registry
from draftsmith.runtime.acceptance.stop_policies import StopPolicy
from draftsmith.runtime.acceptance.verifiers import Acceptance
from draftsmith.runtime.drafting.tree import DraftTree


@dataclass
class StepContext:
    """What a proposer is told, one type for every event of a generation (``begin``, ``propose``, ``accept``).

    Rows of the target forward that just ran, by event (P = prompt length, a = accepted drafted tokens):
    - begin: ``hidden`` [P, H] and ``taps`` [P, k*H] of the prompt, ``logits`` [1, V] at its last position;
    - propose: ``hidden`` [H], the row whose logits gave ``root_token``;
    - accept: ``hidden`` [a+1, H], ``taps`` [a+1, k*H] and ``logits`` [a+1, V] at the accepted nodes (root first;
      ``logits`` is None for a proposer that declares ``reads_logits = False``, which lets greedy verification
      reduce the LM head to an argmax per node),
      and ``acceptance``.
    ``taps`` holds the target layers the proposer declares in ``feature_taps`` (concatenated in that order); None for
    a proposer that declares none.
    """

    tokens: torch.Tensor  # [L+1] prompt + every emitted token; the last one is the root (not yet in the KV cache)
    root_token: int
    hidden: torch.Tensor
    stop_policy: StopPolicy | None = None
    generator: torch.Generator | None = None
    taps: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    acceptance: Acceptance | None = None


@runtime_checkable
class Proposer(Protocol):
    """A drafter seen by the speculative loop. ``feature_taps`` (optional attribute): target layers whose inputs
    the proposer reads (EAGLE-3); the loop then requests them from every target forward."""

    max_tree_nodes: int

    def begin(self, ctx: StepContext) -> None:
        """Start a generation from the prompt's target rows."""
        ...

    def propose(self, ctx: StepContext) -> DraftTree:
        """Draft a tree rooted at ``ctx.root_token``."""
        ...

    def accept(self, ctx: StepContext) -> None:
        """Learn what was accepted (``ctx.acceptance``, the target rows at the accepted nodes)."""
        ...


@runtime_checkable
class LookaheadHeads(Protocol):
    """A proposer whose heads predict several tokens ahead from one target hidden state (Medusa): the bench scores
    each head's top-1 against the target's greedy continuation."""

    def lookahead_top1(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> top-1 target ids [K, T]: head k at position t predicts the token at t+k+2."""
        ...


@runtime_checkable
class WrapsTarget(Protocol):
    """A proposer that drafts with the target's own layers and cache (Kangaroo): the loop runs over
    ``wrap_target(model)``, which shares the KV cache and reuses the shallow layers' states in verification."""

    def wrap_target(self, model: Any) -> Any:
        """The decoder the speculative loop should verify with."""
        ...


@runtime_checkable
class ReportsVerifyReuse(Protocol):
    """A verify model (what ``wrap_target`` returns) that reuses drafted states in verification (Kangaroo's shallow
    layers): the bench reports what the reuse saved."""

    def verify_reuse(self) -> dict[str, float]:
        """``{"reused_tokens", "verified_tokens", "verify_compute_saved"}`` so far."""
        ...


ProposerBuilder = Callable[..., Proposer]
# chain(tokens) -> the builder options for a chain of at most ``tokens`` drafted tokens (see register_chain)
ChainOptions = Callable[[int], dict[str, Any]]


_REGISTRY: Registry[ProposerBuilder] = Registry("runtime proposer for method")


# @register_proposer(method) on builder(export_dir, config, target_model, **kwargs) -> Proposer
register_proposer = _REGISTRY.register
_CHAINS: Registry[ChainOptions] = Registry("chain-drafting proposer for method")
# @register_chain(method) on chain(tokens) -> options: the method's proposer can draft a plain chain, on which
# SpecDec++ and its calibration stack a stop rule; the family says how its builder is asked for one.
register_chain = _CHAINS.register


def chain_options(export_dir: str | Path, tokens: int) -> dict[str, Any]:
    """Builder options that make the proposer of ``export_dir`` draft a chain of at most ``tokens`` tokens; ValueError
    for a method whose proposer drafts no chain."""
    from draftsmith.export.format import read_config

    method = read_config(export_dir)["method"]
    _load_family_of(method)
    if method not in _CHAINS:
        raise ValueError(f"the {method!r} proposer of {export_dir} drafts no chain; chain drafters: "
                         f"{', '.join(_CHAINS) or 'none'}")
    return _CHAINS.get(method)(int(tokens))


def _load_builtin_proposers() -> None:
    """Import every family module of this package (all but ``base`` and ``tree``), which registers its proposers
    (lazily: they import heavier drafter code). A new family's file is found by being here; no list to keep."""
    import importlib
    import pkgutil

    import draftsmith.runtime.drafting as drafting

    for info in pkgutil.iter_modules(drafting.__path__):
        if info.name not in ("base", "tree"):
            importlib.import_module(f"draftsmith.runtime.drafting.{info.name}")


def _load_family_of(method: str) -> None:
    """Import the family module that registers ``method`` (``medusa2`` -> ``medusa.py``, ``hydra_pp`` -> ``hydra.py``,
    ``eagle3`` -> ``eagle.py``), so serving one export imports its own family alone; every family when the name
    leads to none."""
    import importlib
    import importlib.util
    import re

    for name in dict.fromkeys((method, re.sub(r"(_pp|\d+)$", "", method))):
        if method in _REGISTRY:
            return
        if name not in ("base", "tree") and importlib.util.find_spec(f"draftsmith.runtime.drafting.{name}"):
            importlib.import_module(f"draftsmith.runtime.drafting.{name}")
    if method not in _REGISTRY:
        _load_builtin_proposers()


def registered_methods() -> list[str]:
    """Export methods the runtime can draft with."""
    _load_builtin_proposers()
    return list(_REGISTRY)


def check_target_model(config: dict, target_model: Any, identity: dict | None = None, given: str | None = None) -> None:
    """Raise ``TargetMismatchError`` unless ``target_model`` is the target the export ``config`` records.

    Compares what the decoder itself shows (sizes, LM-head digest) with the record; ``identity`` (the full
    :func:`~draftsmith.export.identity.target_identity` of this model, tokenizer included) is checked too when
    given, and then its LM-head digest stands for the model's (no second hash).
    """
    from draftsmith.export.format import check_target
    from draftsmith.export.identity import decoder_identity

    if identity is not None:
        check_target(config, identity, given)
    cfg = getattr(target_model, "config", None)
    layers = getattr(cfg, "num_layers", getattr(cfg, "num_hidden_layers", None))  # lean | HF config
    recorded = config.get("target", {})
    name = given if given is not None else recorded.get("name_or_path", "the loaded target")
    seen = decoder_identity(name, getattr(cfg, "hidden_size", None), layers,
                            getattr(target_model, "lm_head_weight", None),
                            digest=identity is None or "lm_head" not in identity)
    # Compare only what the export records: a hand-written export may record nothing but a name.
    shown = {k: v for k, v in seen.items() if k == "name_or_path" or k in recorded}
    if identity is not None and identity.get("adapter"):  # an adapter merged at load (checked above in full)
        shown["adapter"] = identity["adapter"]
    check_target(config, shown, given)


def build_proposer(export_dir: str | Path, target_model: Any, identity: dict | None = None, given: str | None = None,
                   **kwargs: Any) -> Proposer:
    """Load the proposer of an export folder for ``target_model`` (its method picks the builder).

    Every method is checked against the target first (:func:`check_target_model`): ``identity`` adds the tokenizer
    fingerprint, ``given`` names the target the user passed in the error message.
    """
    from draftsmith.export.format import read_config

    config = read_config(export_dir)
    method = config["method"]
    _load_family_of(method)
    if method not in _REGISTRY:
        raise ValueError(f"no runtime proposer for method {method!r} (export {export_dir}); available: "
                         f"{', '.join(registered_methods()) or 'none'}")
    check_target_model(config, target_model, identity, given)
    return _REGISTRY.get(method)(export_dir, config, target_model, **kwargs)


def module_dtype(module: torch.nn.Module) -> torch.dtype:
    """The floating dtype a drafter module computes in. Its parameters may be gone: the packed bf16 GEMM
    (``runtime.target.fast_linear``) swaps linears for buffers and keeps each weight as a plain attribute."""
    for tensor in module.parameters():
        return tensor.dtype
    for sub in module.modules():
        weight = getattr(sub, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.is_floating_point():
            return weight.dtype
    raise ValueError(f"{type(module).__name__} has no floating weights to take a compute dtype from")


def prune_tree(tree: DraftTree, keep: list[bool]) -> DraftTree:
    """The sub-tree of kept nodes (a kept node's parent must be kept)."""
    new_index = {}
    parents, rows = [], []
    for i, k in enumerate(keep):
        if k:
            new_index[i] = len(rows)
            rows.append(i)
            parents.append(-1 if i == 0 else new_index[int(tree.parents[i])])
    idx = torch.tensor(rows, dtype=torch.long)
    q = tree.draft_q[idx] if tree.draft_q is not None else None
    conf = tree.draft_confidence[idx] if tree.draft_confidence is not None else None
    return DraftTree.from_parents(tree.tokens[idx], parents, q, tree.draft_mode, conf)


class NullProposer:
    """Drafts nothing: the loop becomes plain autoregressive decoding (one target forward per token)."""

    max_tree_nodes = 1

    def begin(self, ctx: StepContext) -> None:
        """Nothing to prepare."""

    def propose(self, ctx: StepContext) -> DraftTree:
        """A root-only tree."""
        return DraftTree.chain([ctx.root_token])

    def accept(self, ctx: StepContext) -> None:
        """Nothing to learn."""
