"""The speculative decoding loop: prefill, then propose a tree, verify it in one target forward, keep the accepted
path in the KV cache, and let the target's bonus token root the next tree.

The bonus token's hidden state comes from the tree forward itself, so a step costs exactly one target forward.
Proposers that declare ``feature_taps`` (EAGLE-3: residual-stream inputs of some target layers) get those taps of the
prompt and of every accepted node from the same forwards (``model.forward_taps``), passed as ``taps=``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from draftsmith.kernels.dispatch import BACKENDS
from draftsmith.runtime.acceptance.stop_policies import StopPolicy
from draftsmith.runtime.acceptance.verifiers import GreedyVerifier, Verifier
from draftsmith.runtime.decoding import metrics
from draftsmith.runtime.drafting.base import DraftState, Proposer


@dataclass
class SpecResult:
    """Output of :meth:`SpeculativeDecoder.generate`."""

    tokens: list[int]  # generated tokens (prompt excluded), truncated at eos / max_new_tokens
    steps: int  # target forwards after the prefill (one per verified tree)
    accepted_per_step: list[int]  # drafted tokens accepted at every step (before truncation)
    acceptance_by_position: list[float]  # [D]: metrics.acceptance_by_position (cumulative, per drafted depth)
    lossless: bool = True  # False when the verifier is lossy (typical acceptance)
    tree_sizes: list[int] = field(default_factory=list)  # nodes per verified tree (root included)
    depths: list[int] = field(default_factory=list)  # deepest draft position of each step's tree

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target forward (:func:`draftsmith.runtime.decoding.metrics.tau`)."""
        return metrics.tau(self.accepted_per_step)


class SpeculativeDecoder:
    """Speculative generation with a target model (runtime interface), a proposer, a verifier and a stop policy.

    ``model`` provides ``allocate_cache(max_len)`` and ``forward(input_ids [T], cache, tree_mask, positions,
    logits_for) -> (logits [T, V], hidden [T, H])`` (e.g. :class:`draftsmith.runtime.target.model.LeanDecoder`); with a
    proposer that declares ``feature_taps`` it must also provide ``forward_taps`` (same arguments plus ``taps``).
    ``max_cache_len``: the longest sequence allowed (default: the model's ``max_position_embeddings``).
    """

    def __init__(
        self,
        model: Any,
        proposer: Proposer,
        verifier: Verifier | None = None,
        stop_policy: StopPolicy | None = None,
        kernels_backend: str = "auto",
        max_cache_len: int | None = None,
    ) -> None:
        if kernels_backend not in BACKENDS:
            raise ValueError(f"unknown kernel backend {kernels_backend!r}; valid backends are {', '.join(BACKENDS)}")
        self.model = model
        self.proposer = proposer
        self.verifier = verifier if verifier is not None else GreedyVerifier(kernels_backend)
        self.stop_policy = stop_policy
        self.kernels_backend = kernels_backend
        cfg = getattr(model, "config", None)
        self.max_cache_len = max_cache_len or getattr(cfg, "max_position_embeddings", None)
        self._cache = None

    def _cache_for(self, needed: int) -> Any:
        if self.max_cache_len is not None and needed > self.max_cache_len:
            raise ValueError(
                f"prompt + max_new_tokens + draft tree need {needed} cache slots but the limit is "
                f"{self.max_cache_len}; shorten the prompt, lower max_new_tokens or raise max_cache_len")
        if self._cache is None or self._cache.max_len < needed:
            self._cache = self.model.allocate_cache(needed)
        self._cache.length = 0
        return self._cache

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor | Sequence[int],
        max_new_tokens: int,
        eos_ids: Sequence[int] = (),
        generator: torch.Generator | None = None,
        stream: Callable[[list[int]], None] | None = None,
    ) -> SpecResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` [P] (stop after any of ``eos_ids``).

        ``generator`` drives every random choice (sampling verifiers and sampling drafters); ``stream`` is called
        with each new chunk of tokens as soon as it is final.
        """
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().cpu()
        if prompt.numel() == 0:
            raise ValueError("the prompt is empty: pass at least one token id (e.g. the BOS token)")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        lossless = bool(getattr(self.verifier, "lossless", False))
        if max_new_tokens == 0:
            return SpecResult([], 0, [], [], lossless)
        taps = tuple(int(i) for i in (getattr(self.proposer, "feature_taps", None) or ()))
        if taps and not callable(getattr(self.model, "forward_taps", None)):
            raise ValueError(f"the proposer needs the target's layer taps {list(taps)} but {type(self.model).__name__} "
                             "has no forward_taps; load the target with the lean decoder (backend='lean')")
        cache = self._cache_for(prompt.numel() + max_new_tokens + self.proposer.max_tree_nodes)
        device = getattr(self.model, "device", torch.device("cpu"))
        eos = set(int(e) for e in eos_ids)

        logits, hidden, feats = self._forward(taps, prompt.to(device), cache, logits_for="last")  # [1, V], [P, H]
        cache.commit(prompt.numel())
        self.proposer.begin(prompt, hidden, logits, **({"taps": feats} if taps else {}))
        root = self.verifier.sample(logits[-1], generator)
        out: list[int] = []
        done = self._emit(out, [root], max_new_tokens, eos, stream)
        hidden_prev = hidden[-1]  # [H] the hidden whose logits produced the root
        accepted, sizes, depth_hist = [], [], []
        while not done:
            state = DraftState(torch.tensor([*prompt.tolist(), *out]), root, hidden_prev, self.stop_policy, generator)
            tree = self.proposer.propose(state)
            if int(tree.tokens[0]) != root:
                raise ValueError("the proposer's tree must start with the root token it was given")
            if tree.num_nodes > self.proposer.max_tree_nodes:
                raise ValueError(f"the proposer drafted {tree.num_nodes} nodes but declared max_tree_nodes="
                                 f"{self.proposer.max_tree_nodes}; the KV cache is sized from the latter")
            prefix = cache.length
            positions = (prefix + tree.depths).to(device)  # siblings share a position
            mask = tree.tree_mask.to(device) if tree.num_nodes > 1 else None
            logits, hidden, feats = self._forward(taps, tree.tokens.to(device), cache, tree_mask=mask,
                                                  positions=positions)
            acc = self.verifier.verify(tree, logits, generator)
            nodes = acc.path_nodes
            if nodes == list(range(len(nodes))):  # accepted nodes already sit right after the prefix
                cache.commit(len(nodes))
            else:
                cache.compact(prefix + torch.tensor(nodes, dtype=torch.long), prefix)
            rows = torch.tensor(nodes, device=hidden.device)
            path_hidden = hidden[rows]  # [a+1, H]
            if taps:  # the taps of every accepted node, root first: [a+1, len(taps)*H]
                self.proposer.accept(acc, path_hidden, taps=feats[rows.to(feats.device)])
            else:
                self.proposer.accept(acc, path_hidden)
            hidden_prev = path_hidden[-1]
            root = acc.bonus_token
            accepted.append(acc.num_accepted)
            sizes.append(tree.num_nodes)
            depth_hist.append(int(tree.depths.max()))
            done = self._emit(out, [*acc.accepted_tokens, root], max_new_tokens, eos, stream)
        return SpecResult(out, len(accepted), accepted, metrics.acceptance_by_position(accepted, depth_hist), lossless,
                          sizes, depth_hist)

    def _forward(self, taps: tuple[int, ...], input_ids: torch.Tensor, cache: Any,
                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Target forward -> (logits, hidden [T, H], taps concatenated in ``taps`` order [T, k*H] or None)."""
        if not taps:
            logits, hidden = self.model.forward(input_ids, cache, **kwargs)
            return logits, hidden, None
        logits, hidden, found = self.model.forward_taps(input_ids, cache, taps=taps, **kwargs)
        return logits, hidden, torch.cat([found[i] for i in taps], dim=-1)  # [T, k*H]

    @staticmethod
    def _emit(out: list[int], new: list[int], limit: int, eos: set[int], stream: Callable | None) -> bool:
        """Append ``new`` up to the limit / first eos; return True when generation is over."""
        chunk = []
        for t in new:
            if len(out) >= limit:
                break
            out.append(t)
            chunk.append(t)
            if t in eos:
                break
        if stream is not None and chunk:
            stream(chunk)
        return len(out) >= limit or (bool(out) and out[-1] in eos)
