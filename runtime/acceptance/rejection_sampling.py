"""Lossless tree verification: multi-candidate rejection sampling of the target distribution
against the drafted tree (point-mass, with-replacement and without-replacement drafts)."""

from __future__ import annotations

import torch

from draftsmith.common.errors import InputError
from draftsmith.runtime.acceptance.verifiers import (
    Acceptance,
    Verifier,
    on_generator_device,
    target_probs,
)
from draftsmith.runtime.drafting.tree import DraftTree


class RejectionSamplingVerifier(Verifier):
    """Tree speculative sampling that preserves the target distribution exactly (temperature / top-p
    applied to p).

    Walk from the root. At each node, with p the target distribution there, try its children in
    drafted order:
    - stochastic children drawn from q (``draft_q`` of the parent): accept x with min(1, p(x)/q(x));
      on rejection p <- norm(max(0, p - q)) and, if siblings were drawn without replacement, q <- q
      with x removed, renormalised (multi-candidate speculative sampling, SpecInfer / EAGLE-1). Each
      step is ordinary rejection sampling of p against the conditional law of the next sibling given
      the earlier ones, so the emitted token is exactly ~ p.
    - deterministic children (``point_mass``: top-k drafts, Medusa heads, greedy chains): the
      proposal is the point mass at x, so min(1, p(x)/1) = p(x) and the residual max(0, p - delta_x)
      normalised is p with x zeroed and renormalised. The emitted token is then x with probability
      p(x) and otherwise drawn from p(. | != x): exactly p. Because the children only depend on the
      context (not on the target's coin flips), this holds at every depth, so the whole emitted
      sequence has the target's law.
    If every child is rejected (or the node is a leaf), the bonus token is drawn from the current
    residual p.

    The point-mass rule is exact for any child chosen independently of the verifier's coin flips,
    sampled ones included (EAGLE-2/3 apply it to top-k drafts); with a recorded q the min(1, p/q)
    rule accepts more often.
    """

    lossless = True
    per_position_temperature = True

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0) -> None:
        if temperature <= 0:
            raise InputError(
                "rejection sampling needs temperature > 0; use GreedyVerifier for temperature 0"
            )
        if not 0 < top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature = temperature
        self.top_p = top_p

    def sample(
        self,
        logits: torch.Tensor,
        generator: torch.Generator | None = None,
        temperature: torch.Tensor | None = None,
    ) -> int:
        """Draw from the (temperature, top-p) target distribution (``temperature`` []: this draw's
        own)."""
        t = self.temperature if temperature is None else temperature.reshape(logits.shape[:-1])
        return _sample(target_probs(logits, t, self.top_p), generator)

    def verify(
        self,
        tree: DraftTree,
        logits: torch.Tensor,
        generator: torch.Generator | None = None,
        temperature: torch.Tensor | None = None,
    ) -> Acceptance:
        """Walk the tree with (multi-candidate) rejection sampling; see the class docstring.
        ``temperature`` [N] replaces the verifier's temperature node by node (0 = greedy there),
        e.g. from an adaptive-temperature layer: the emitted sequence then has exactly the law of
        sampling each position at its own temperature.
        """
        logits = on_generator_device(logits, generator)  # [N, V]
        if temperature is not None and temperature.shape != logits.shape[:1]:
            raise ValueError(
                f"per-node temperatures must have shape [{logits.shape[0]}], "
                f"got {tuple(temperature.shape)}"
            )
        node, nodes = 0, [0]
        while True:
            t = self.temperature if temperature is None else temperature[node]
            p = target_probs(logits[node], t, self.top_p)  # [V] float64
            chosen, p = _try_children(tree, node, p, generator)
            if chosen is None:
                return Acceptance(
                    nodes,
                    [int(tree.tokens[i]) for i in nodes[1:]],
                    _sample(p, generator),
                    len(nodes) - 1,
                )
            node = chosen
            nodes.append(node)


def _try_children(
    tree: DraftTree, node: int, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[int | None, torch.Tensor]:
    """Try ``node``'s children in drafted order against the target distribution ``p`` [V] float64:
    -> (the accepted child, p) or (None, the residual p the bonus token is drawn from)."""
    point_mass = tree.draft_mode == "point_mass"
    without_replacement = tree.draft_mode == "without_replacement"
    q = None if point_mass else tree.draft_q[node].to(p.device, torch.float64).clone()  # [V]
    for child in tree.children(node):
        x = int(tree.tokens[child])
        if point_mass:
            accept_prob = float(p[x])
        else:
            if float(q[x]) <= 0:
                raise ValueError(
                    f"node {child} drafted token {x} which has probability 0 under its"
                    " recorded draft distribution; the proposer's draft_q is inconsistent"
                )
            accept_prob = min(1.0, float(p[x] / q[x]))
        if _uniform(generator) < accept_prob:
            return child, p
        if point_mass:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - q).clamp(min=0.0)
            if without_replacement:
                q[x] = 0.0
                q = q / q.sum() if float(q.sum()) > 0 else q
        total = float(residual.sum())
        if total > 1e-12:  # == 0 only when x could not have been rejected; keep p then
            p = residual / total
    return None, p


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(on_generator_device(probs, generator), 1, generator=generator))


def _uniform(generator: torch.Generator | None) -> float:
    device = generator.device if generator is not None else "cpu"
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=device))
