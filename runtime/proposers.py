"""Proposers: what drafts a tree each step. Registered by export ``method`` so the runtime can load any export.

Protocol: ``begin(prompt_ids, prefill_hidden, prefill_logits)`` once per generation, ``propose(state) -> DraftTree``
every step, ``accept(acceptance, new_hidden)`` after verification (``new_hidden [a+1, H]``: the target's post-norm
hidden states at the accepted path's nodes, root first; ``acceptance`` has the accepted tokens and the bonus token).
``max_tree_nodes`` bounds the nodes of any proposed tree (root included); the decoder sizes the KV cache with it.
A proposer that needs residual-stream taps of the target (EAGLE-3) declares ``feature_taps`` (layer indices as in
``LeanDecoder.forward_taps``); the loop then also passes ``taps=`` ([T, len(feature_taps) * H], concatenated in that
order) to ``begin`` (the prompt's) and ``accept`` (the accepted nodes'). Proposers without it keep two arguments.

EAGLE-1/EAGLE-3 proposers live in :mod:`draftsmith.runtime.proposers_eagle` (imported on first use).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from draftsmith.common.registry import Registry
from draftsmith.runtime.tree import DraftTree, StaticTree
from draftsmith.runtime.verify import Acceptance, StopPolicy, on_generator_device, target_probs


@dataclass
class DraftState:
    """What a proposer sees at the start of a step."""

    tokens: torch.Tensor  # [L+1] prompt + every emitted token; the last one is the root (not yet in the KV cache)
    root_token: int
    hidden: torch.Tensor  # [H] target post-norm hidden at the position before the root (its logits gave the root)
    stop_policy: StopPolicy | None = None
    generator: torch.Generator | None = None


@runtime_checkable
class Proposer(Protocol):
    """A drafter seen by the speculative loop."""

    max_tree_nodes: int

    def begin(self, prompt_ids: torch.Tensor, prefill_hidden: torch.Tensor, prefill_logits: torch.Tensor) -> None:
        """Start a generation: prompt [P], target hidden [P, H], target logits of the last prompt position [1, V]."""
        ...

    def propose(self, state: DraftState) -> DraftTree:
        """Draft a tree rooted at ``state.root_token``."""
        ...

    def accept(self, acceptance: Acceptance, new_hidden: torch.Tensor) -> None:
        """Learn what was accepted (``new_hidden [a+1, H]`` at the accepted nodes)."""
        ...


ProposerBuilder = Callable[..., Proposer]
_REGISTRY: Registry[ProposerBuilder] = Registry("runtime proposer for method")
# @register_proposer(method) on builder(export_dir, config, target_model, **kwargs) -> Proposer
register_proposer = _REGISTRY.register


def _load_builtin_proposers() -> None:
    """Import every ``draftsmith.runtime.proposers_<family>`` module, which registers its proposers (lazily: they
    import heavier drafter code). A new family's file is found by its name; no list to keep."""
    import importlib
    import pkgutil

    import draftsmith.runtime as runtime_pkg

    for info in pkgutil.iter_modules(runtime_pkg.__path__):
        if info.name.startswith("proposers_"):
            importlib.import_module(f"draftsmith.runtime.{info.name}")


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
    check_target(config, {k: v for k, v in seen.items() if k == "name_or_path" or k in recorded}, given)


def build_proposer(export_dir: str | Path, target_model: Any, identity: dict | None = None, given: str | None = None,
                   **kwargs: Any) -> Proposer:
    """Load the proposer of an export folder for ``target_model`` (its method picks the builder).

    Every method is checked against the target first (:func:`check_target_model`): ``identity`` adds the tokenizer
    fingerprint, ``given`` names the target the user passed in the error message.
    """
    from draftsmith.export.format import read_config

    config = read_config(export_dir)
    method = config["method"]
    _load_builtin_proposers()
    if method not in _REGISTRY:
        raise ValueError(f"no runtime proposer for method {method!r} (export {export_dir}); available: "
                         f"{', '.join(registered_methods()) or 'none'}")
    check_target_model(config, target_model, identity, given)
    return _REGISTRY.get(method)(export_dir, config, target_model, **kwargs)


def _prune(tree: DraftTree, keep: list[bool]) -> DraftTree:
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

    def begin(self, prompt_ids: torch.Tensor, prefill_hidden: torch.Tensor, prefill_logits: torch.Tensor) -> None:
        """Nothing to prepare."""

    def propose(self, state: DraftState) -> DraftTree:
        """A root-only tree."""
        return DraftTree.chain([state.root_token])

    def accept(self, acceptance: Acceptance, new_hidden: torch.Tensor) -> None:
        """Nothing to learn."""


class MedusaProposer:
    """Medusa heads on the target's hidden state fill a static tree with each head's top-k tokens.

    ``heads``: an nn.Module mapping hidden [..., H] to logits [K, ..., V] (head k predicts the token k+2 after the
    hidden's position, i.e. k+1 after the root). Children are deterministic (point masses), which the rejection
    sampler handles exactly. A stop policy prunes the tree: a node's children are dropped when
    ``should_stop(depth, head probability of the node's token, target hidden)`` says so.
    """

    def __init__(self, heads: nn.Module, tree: StaticTree | list[list[int]], top_k: int | None = None) -> None:
        if not isinstance(tree, StaticTree):
            tree = StaticTree.from_paths(tree, top_k or 1 + max(c for p in tree for c in p))
        self.heads = heads
        self.tree = tree
        self.max_tree_nodes = tree.num_nodes

    def begin(self, prompt_ids: torch.Tensor, prefill_hidden: torch.Tensor, prefill_logits: torch.Tensor) -> None:
        """Medusa is stateless across steps."""

    @torch.no_grad()
    def propose(self, state: DraftState) -> DraftTree:
        """Run the heads on ``state.hidden`` and fill the static tree."""
        logits = self.heads(state.hidden)  # [K, V]
        if logits.dim() != 2 or logits.shape[0] < self.tree.depth:
            raise ValueError(f"Medusa heads returned logits {tuple(logits.shape)}; the tree needs {self.tree.depth} "
                             "heads, each giving [V] for a hidden [H]")
        top_p, top_i = torch.softmax(logits.float(), -1).topk(self.tree.top_k, dim=-1)  # [K, top_k]
        tree = self.tree.build(state.root_token, top_i)
        conf = torch.cat([torch.ones(1, device=top_p.device), top_p.reshape(-1)])[self.tree.candidate_index.to(top_p.device)]
        tree.draft_confidence = conf.cpu()  # [N]
        policy = state.stop_policy
        if policy is None:
            return tree
        keep = [True] * tree.num_nodes
        expand = [False] * tree.num_nodes  # may node i have children?
        for i in range(tree.num_nodes):
            if i > 0:
                keep[i] = keep[int(tree.parents[i])] and expand[int(tree.parents[i])]
            if keep[i]:
                expand[i] = not policy.should_stop(int(tree.depths[i]), float(conf[i]), state.hidden)
        return tree if all(keep) else _prune(tree, keep)

    def accept(self, acceptance: Acceptance, new_hidden: torch.Tensor) -> None:
        """Nothing to learn: the next step reads the hidden state from the DraftState."""


class ChainProposer:
    """A chain of ``depth`` tokens from a next-token drafter (a tree with one path).

    ``drafter(token_ids [L]) -> logits [V]`` for the token after ``token_ids`` (e.g. :class:`DecoderDrafter` over a
    small LM). ``temperature == 0`` drafts greedily (point masses); otherwise it samples from
    softmax(logits / temperature) within ``top_p`` and records q for the rejection sampler.
    """

    def __init__(self, drafter: Callable[[torch.Tensor], torch.Tensor], depth: int = 4, temperature: float = 0.0,
                 top_p: float = 1.0) -> None:
        if depth < 1:
            raise ValueError(f"chain depth must be >= 1, got {depth}")
        self.drafter = drafter
        self.depth = depth
        self.temperature = temperature
        self.top_p = top_p
        self.max_tree_nodes = depth + 1

    def begin(self, prompt_ids: torch.Tensor, prefill_hidden: torch.Tensor, prefill_logits: torch.Tensor) -> None:
        """Stateless: the drafter sees the full token sequence each call."""

    @torch.no_grad()
    def propose(self, state: DraftState) -> DraftTree:
        """Draft up to ``depth`` tokens (fewer if the stop policy says so)."""
        seq = state.tokens
        tokens, qs, confs = [state.root_token], [], [1.0]
        policy = state.stop_policy
        max_depth = min(self.depth, policy.max_depth) if policy is not None else self.depth
        while len(tokens) - 1 < max_depth:
            logits = on_generator_device(self.drafter(seq).float(), state.generator)  # [V]
            if self.temperature > 0:
                q = target_probs(logits, self.temperature, self.top_p)  # [V] float64
                x = int(torch.multinomial(q, 1, generator=state.generator))
            else:
                q = torch.softmax(logits.double(), -1)
                x = int(q.argmax())
            qs.append(q.cpu())
            tokens.append(x)
            confs.append(float(q[x]))
            seq = torch.cat([seq, seq.new_tensor([x])])
            if policy is not None and policy.should_stop(len(tokens) - 1, confs[-1], None):
                break
        if self.temperature > 0:
            draft_q = torch.stack(qs + [torch.zeros_like(qs[0])])  # [N, V]; the leaf has no children
            tree = DraftTree.chain(tokens, draft_q, "with_replacement")
        else:
            tree = DraftTree.chain(tokens)
        tree.draft_confidence = torch.tensor(confs)
        return tree

    def accept(self, acceptance: Acceptance, new_hidden: torch.Tensor) -> None:
        """Stateless."""


class SampledTreeProposer:
    """A tree from a next-token drafter: node at depth d gets ``branching[d]`` children (EAGLE-1-style sampling tree).

    ``temperature > 0``: children drawn from q = softmax(logits / temperature) within ``top_p``, i.i.d.
    (``replacement=True``, duplicates allowed) or one after another without replacement; q is recorded for the
    rejection sampler; without replacement a node gets fewer children when the ``top_p`` nucleus holds fewer
    tokens. ``temperature == 0``: the top-``branching[d]`` tokens (point masses, EAGLE-2-style top-k).
    A stop policy can leave a node unexpanded.
    """

    def __init__(self, drafter: Callable[[torch.Tensor], torch.Tensor], branching: tuple[int, ...] = (2, 2),
                 temperature: float = 1.0, top_p: float = 1.0, replacement: bool = True) -> None:
        if not branching or min(branching) < 1:
            raise ValueError(f"branching must be a non-empty sequence of positive ints, got {branching}")
        self.drafter = drafter
        self.branching = tuple(int(b) for b in branching)
        self.temperature = temperature
        self.top_p = top_p
        self.replacement = replacement
        width, total = 1, 1
        for b in self.branching:
            width *= b
            total += width
        self.max_tree_nodes = total

    def begin(self, prompt_ids: torch.Tensor, prefill_hidden: torch.Tensor, prefill_logits: torch.Tensor) -> None:
        """Stateless."""

    @torch.no_grad()
    def propose(self, state: DraftState) -> DraftTree:
        """Expand nodes breadth-first (parents always precede children)."""
        tokens, parents, depths, confs, seqs = [state.root_token], [-1], [0], [1.0], [state.tokens]
        qs: list[torch.Tensor | None] = [None]
        policy = state.stop_policy
        i = 0
        while i < len(tokens):
            d = depths[i]
            stop = d >= len(self.branching) or (
                policy is not None and (d >= policy.max_depth or policy.should_stop(d, confs[i], None)))
            if not stop:
                logits = on_generator_device(self.drafter(seqs[i]).float(), state.generator)  # [V]
                k = self.branching[d]
                if self.temperature > 0:
                    q = target_probs(logits, self.temperature, self.top_p)  # [V] float64
                    if not self.replacement:
                        # Without replacement a nucleus of n < k tokens yields n children: torch would either
                        # fail or return zero-probability tokens. n depends on q only, never on the verifier's
                        # coins, so the rejection sampler stays exact (it then draws from the residual).
                        k = min(k, int(torch.count_nonzero(q)))
                    kids = torch.multinomial(q, k, replacement=self.replacement, generator=state.generator)  # [k]
                else:
                    q = torch.softmax(logits.double(), -1)
                    kids = q.topk(k).indices
                qs[i] = q.cpu()
                for x in kids.tolist():
                    tokens.append(x)
                    parents.append(i)
                    depths.append(d + 1)
                    confs.append(float(q[x]))
                    seqs.append(torch.cat([seqs[i], seqs[i].new_tensor([x])]))
                    qs.append(None)
            i += 1
        if self.temperature > 0:
            vocab = next(q for q in qs if q is not None).numel() if any(q is not None for q in qs) else 1
            draft_q = torch.stack([q if q is not None else torch.zeros(vocab, dtype=torch.float64) for q in qs])
            mode = "with_replacement" if self.replacement else "without_replacement"
            return DraftTree.from_parents(tokens, parents, draft_q, mode, torch.tensor(confs))
        return DraftTree.from_parents(tokens, parents, draft_confidence=torch.tensor(confs))

    def accept(self, acceptance: Acceptance, new_hidden: torch.Tensor) -> None:
        """Stateless."""


class DecoderDrafter:
    """Next-token drafter over a decoder with the runtime interface (``allocate_cache``, ``forward``).

    Keeps its own KV cache and reuses the longest common prefix between calls, so a chain costs one token-forward per
    drafted token plus the tokens accepted since the last call.
    """

    def __init__(self, model: Any, max_len: int = 2048) -> None:
        self.model = model
        self.max_len = max_len
        self.cache = None
        self.ids = torch.empty(0, dtype=torch.long)

    @torch.no_grad()
    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits [V] of the token after ``token_ids`` [L]."""
        if token_ids.numel() == 0:
            raise ValueError("the drafter needs at least one token")
        if token_ids.numel() > self.max_len:
            raise ValueError(f"{token_ids.numel()} tokens exceed the drafter's cache ({self.max_len}); raise max_len")
        if self.cache is None:
            self.cache = self.model.allocate_cache(self.max_len)
        ids = token_ids.cpu()
        n = min(self.cache.length, ids.numel() - 1)  # always feed at least the last token to get its logits
        same = (self.ids[:n] == ids[:n]).long()
        lcp = int(same.cumprod(0).sum()) if n > 0 else 0
        self.cache.length = lcp  # roll back to the common prefix
        new = token_ids[lcp:]
        device = getattr(self.model, "device", token_ids.device)
        logits, _ = self.model.forward(new.to(device), self.cache, logits_for="last")  # [1, V]
        self.cache.commit(new.numel())
        self.ids = ids.clone()
        return logits[-1]


@register_proposer("medusa")
def _build_medusa(export_dir: str | Path, config: dict, target_model: Any, tree: list[list[int]] | None = None,
                  top_k: int | None = None, **_: Any) -> MedusaProposer:
    """Medusa heads from an export, on the target's device/dtype; tree and top_k default to the export's."""
    from draftsmith.heads.medusa import MedusaHeads
    from draftsmith.runtime.fast_linear import accelerate_linears

    lm_head = getattr(target_model, "lm_head_weight", None)
    heads = MedusaHeads.from_export(export_dir, lm_head_weight=lm_head)
    if lm_head is not None:  # run the heads where and in the precision the target runs
        heads = heads.to(device=lm_head.device, dtype=lm_head.dtype)
        accelerate_linears(heads)  # bf16 on CPU: packed GEMM for the heads' linears
    inference = config.get("inference", {})
    paths = tree or inference.get("tree")
    k = top_k or inference.get("top_k", 10)
    if not paths:
        from draftsmith.runtime.tree import default_medusa_tree

        paths = default_medusa_tree(heads.config.num_heads, top_k=min(k, 4))
    return MedusaProposer(heads.eval(), StaticTree.from_paths(paths, k))
