"""Verifiers: which drafted path the target accepts (greedy, typical acceptance, lossless rejection
sampling)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.common.errors import InputError
from draftsmith.kernels.verify import greedy_verify, greedy_walk, target_argmax
from draftsmith.runtime.drafting.tree import DraftTree


@dataclass
class Acceptance:
    """Outcome of verifying one tree. ``path_nodes`` starts with the root (node 0)."""

    path_nodes: list[int]
    accepted_tokens: list[int]  # tokens of path_nodes[1:]
    bonus_token: int
    num_accepted: int  # len(accepted_tokens); tokens emitted this step = num_accepted + 1


def target_probs(
    logits: torch.Tensor, temperature: float | torch.Tensor, top_p: float = 1.0
) -> torch.Tensor:
    """softmax(logits / temperature) restricted to the top-p nucleus and renormalised, in float64
    (``[..., V]``).

    ``temperature`` is a float or a tensor of one temperature per row (shape ``logits.shape[:-1]``);
    a row at temperature 0 is the point mass at its argmax (greedy decoding as a distribution).
    """
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(logits.device, torch.float64)
        if t.shape != logits.shape[:-1]:
            raise ValueError(
                f"per-row temperatures must have shape {tuple(logits.shape[:-1])}, got"
                f" {tuple(t.shape)}"
            )
        if bool((t < 0).any()) or not bool(torch.isfinite(t).all()):
            raise ValueError("temperatures must be finite and >= 0")
        greedy = t == 0
        probs = torch.softmax(logits.double() / torch.where(greedy, 1.0, t)[..., None], dim=-1)
        if bool(greedy.any()):
            onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
            probs = torch.where(greedy[..., None], onehot, probs)
    else:
        probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep a token if the mass strictly before it is < top_p (the smallest set reaching top_p).
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def on_generator_device(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``x`` on the generator's device (random draws must happen where the generator lives)."""
    return x if generator is None or x.device == generator.device else x.to(generator.device)


class Verifier:
    """What the speculative loop needs from a verifier: every member it reads, declared with its
    default."""

    # True when the output distribution equals the target's (greedy: identical tokens)
    lossless: bool = False
    # verify/sample take a per-node ``temperature`` (an adaptive policy)
    per_position_temperature: bool = False
    # verify_argmax decides from the target's argmax per node alone
    decides_from_argmax: bool = False

    def verify(
        self,
        tree: DraftTree,
        logits: torch.Tensor,
        generator: torch.Generator | None = None,
        temperature: torch.Tensor | None = None,
    ) -> Acceptance:
        """Accept a path of ``tree`` given target logits [N, V] at every node (``temperature`` [N]:
        a per-node sampling temperature, for verifiers with ``per_position_temperature``)."""
        raise NotImplementedError(f"{type(self).__name__} must define verify()")

    def verify_argmax(self, tree: DraftTree, argmax: torch.Tensor) -> Acceptance:
        """The decision from the target's argmax at every node [N] alone (verifiers with
        ``decides_from_argmax``)."""
        raise NotImplementedError(
            f"{type(self).__name__} decides from the logits, not their argmax"
        )

    def sample(
        self,
        logits: torch.Tensor,
        generator: torch.Generator | None = None,
        temperature: torch.Tensor | None = None,
    ) -> int:
        """Draw one token from the target logits [V] (the first token after the prompt)."""
        raise NotImplementedError(f"{type(self).__name__} must define sample()")


def _no_temperature(verifier: object, temperature: torch.Tensor | None) -> None:
    if temperature is not None:
        raise InputError(
            f"{type(verifier).__name__} has one fixed law; per-position temperatures need the "
            "rejection-sampling verifier (verifier=rejection)"
        )


class GreedyVerifier(Verifier):
    """Lossless greedy: the longest path whose drafted tokens equal the target argmax; bonus =
    argmax after it."""

    lossless = True
    decides_from_argmax = True

    def __init__(self, kernel_backend: str = "auto") -> None:
        self.kernel_backend = kernel_backend

    def verify(
        self,
        tree: DraftTree,
        logits: torch.Tensor,
        generator: torch.Generator | None = None,
        temperature: torch.Tensor | None = None,
    ) -> Acceptance:
        """See :func:`draftsmith.kernels.verify.greedy_verify` (on a CPU:
        :func:`~draftsmith.kernels.verify.greedy_walk`, the same decision over host lists)."""
        _no_temperature(self, temperature)
        if (
            logits.device.type == "cpu"
            and self.kernel_backend in ("auto", "torch")
            and logits.dim() == 2
            and logits.shape[0] == tree.num_nodes
        ):  # anything else: greedy_verify checks it and says why
            # Host fast path: one argmax, then the walk over Python lists
            # (kernels.verify.greedy_walk).
            return self.verify_argmax(tree, target_argmax(logits))
        paths = tree.retrieve_indices.to(logits.device)
        res = greedy_verify(
            paths, tree.tokens.to(logits.device), logits, backend=self.kernel_backend
        )
        nodes = [int(i) for i in paths[res.best_path, : res.accept_len + 1]]
        toks = [int(tree.tokens[i]) for i in nodes[1:]]
        return Acceptance(nodes, toks, res.bonus_token, res.accept_len)

    def verify_argmax(self, tree: DraftTree, argmax: torch.Tensor) -> Acceptance:
        """The same decision from the target's argmax at every node [N] alone (a target forward with
        ``head="argmax"`` gives it without any [N, V] logits):
        :func:`~draftsmith.kernels.verify.greedy_walk` over host lists."""
        if argmax.shape != (tree.num_nodes,):
            raise ValueError(
                f"need the target argmax at each of the {tree.num_nodes} nodes, got"
                f" {tuple(argmax.shape)}"
            )
        paths_list = tree.retrieve_indices.tolist()
        tokens_list = tree.tokens.tolist()
        best, accept_len, bonus = greedy_walk(paths_list, tokens_list, argmax.tolist())
        nodes = paths_list[best][: accept_len + 1]
        return Acceptance(nodes, [tokens_list[i] for i in nodes[1:]], bonus, accept_len)

    def sample(
        self,
        logits: torch.Tensor,
        generator: torch.Generator | None = None,
        temperature: torch.Tensor | None = None,
    ) -> int:
        """Target argmax."""
        _no_temperature(self, temperature)
        return int(logits.argmax(-1))


class TypicalVerifier(Verifier):
    """Medusa's typical acceptance (LOSSY: the output distribution is not the target's).

    A drafted token x is accepted if ``p(x) > min(posterior_threshold, posterior_alpha *
    exp(-H(p)))`` with p the target distribution at temperature ``temperature``; the longest
    accepted path wins (ties: higher sum of log p). As in Medusa's fast mode the bonus and first
    tokens are the target argmax.
    """

    lossless = False

    def __init__(
        self,
        posterior_threshold: float = 0.09,
        posterior_alpha: float = 0.3,
        temperature: float = 0.7,
    ) -> None:
        if temperature <= 0:
            raise InputError(
                "typical acceptance needs temperature > 0; use GreedyVerifier for temperature 0"
            )
        self.posterior_threshold = posterior_threshold
        self.posterior_alpha = posterior_alpha
        self.temperature = temperature

    def verify(
        self,
        tree: DraftTree,
        logits: torch.Tensor,
        generator: torch.Generator | None = None,
        temperature: torch.Tensor | None = None,
    ) -> Acceptance:
        """Accept the longest path whose tokens are all typical under the target."""
        _no_temperature(self, temperature)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)  # [N, V]
        entropy = -(probs * torch.log(probs + 1e-5)).sum(-1)  # [N]
        threshold = torch.minimum(
            torch.full_like(entropy, self.posterior_threshold),
            self.posterior_alpha * torch.exp(-entropy),
        )  # [N]
        paths = tree.retrieve_indices.to(logits.device)  # [P, D+1]
        parent, child = paths[:, :-1].clamp(min=0), paths[:, 1:]
        tokens = tree.tokens.to(logits.device)
        p_child = probs[
            parent, tokens[child.clamp(min=0)]
        ]  # [P, D] p of each drafted token under its parent
        ok = (child >= 0) & (p_child > threshold[parent])
        alive = ok.long().cumprod(dim=1)  # [P, D]
        lens = alive.sum(1)  # [P]
        score = (torch.log(p_child.clamp(min=1e-30)) * alive).sum(1)  # tie-break among the longest
        best_len = int(lens.max())
        cand = torch.nonzero(lens == best_len).flatten()
        best = int(cand[score[cand].argmax()])
        nodes = [int(i) for i in paths[best, : best_len + 1]]
        return Acceptance(
            nodes,
            [int(tree.tokens[i]) for i in nodes[1:]],
            int(logits[nodes[-1]].argmax()),
            best_len,
        )

    def sample(
        self,
        logits: torch.Tensor,
        generator: torch.Generator | None = None,
        temperature: torch.Tensor | None = None,
    ) -> int:
        """Target argmax (Medusa fast mode)."""
        _no_temperature(self, temperature)
        return int(logits.argmax(-1))
