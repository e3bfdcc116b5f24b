"""The speculative decoding loop: prefill, then propose a tree, verify it in one target forward,
keep the accepted path in the KV cache, and let the target's bonus token root the next tree.

The bonus token's hidden state comes from the tree forward itself, so a step
(runtime/decoding/speculative_step.py) costs exactly one target forward. Proposers hear about each
event through one :class:`~draftsmith.runtime.drafting.base.StepContext`; those that declare
``feature_taps`` (EAGLE-3: residual-stream inputs of some target layers) find those taps of the
prompt and of every accepted node in it, requested from the same forwards. An optional
``temperature_policy`` (an adaptive-temperature layer) gives every position its own sampling
temperature from the target's hidden state there; the verifier then samples (and verifies) each
node at its own temperature.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch

from draftsmith.common.errors import InputError
from draftsmith.kernels.dispatch import BACKENDS
from draftsmith.runtime.acceptance.stop_policies import StopPolicy
from draftsmith.runtime.acceptance.verifiers import GreedyVerifier, Verifier
from draftsmith.runtime.decoding.profile import StepProfiler
from draftsmith.runtime.decoding.prompt_limits import cap_new_tokens
from draftsmith.runtime.decoding.spec_result import GenerationRecord, SpecResult
from draftsmith.runtime.decoding.speculative_step import LoopState, speculative_step
from draftsmith.runtime.decoding.threads import governor
from draftsmith.runtime.drafting.base import NullProposer, Proposer, StepContext
from draftsmith.runtime.target.cache import TokenBuffer
from draftsmith.runtime.target.interface import RuntimeCache, TargetDecoder


class SpeculativeDecoder:
    """Speculative generation with a target model (runtime interface), a proposer, a verifier and a
    stop policy.

    ``model``: a :class:`~draftsmith.runtime.target.interface.TargetDecoder`
    (``allocate_cache(max_len)``, ``forward(input_ids [T], cache, tree_mask, positions, logits_for,
    taps, head) -> TargetOutput``).
    ``proposer``: a :class:`~draftsmith.runtime.drafting.base.Proposer` (the loop reads only its
    declared members).
    ``temperature_policy``: ``hidden [T, H] -> temperatures [T]`` (0 = greedy at that position),
    needs a verifier with ``per_position_temperature`` (rejection sampling).
    ``max_cache_len``: a cap on the KV cache slots (prompt + max_new_tokens + one tree); None: the
    cache is sized from each request, as plain decoding sizes it. A prompt that leaves no position
    in the target's context is refused and ``max_new_tokens`` past it capped
    (:func:`~draftsmith.runtime.decoding.prompt_limits.cap_new_tokens`).
    ``head``: "auto" (greedy verification reduces the LM head to an argmax per node where the
    target, verifier and proposer allow it, :meth:`uses_argmax_head`) or "logits" (always the [N, V]
    logits).
    """

    def __init__(
        self,
        model: TargetDecoder,
        proposer: Proposer,
        verifier: Verifier | None = None,
        stop_policy: StopPolicy | None = None,
        kernel_backend: str = "auto",
        max_cache_len: int | None = None,
        temperature_policy: Callable[[torch.Tensor], torch.Tensor] | None = None,
        head: str = "auto",
    ) -> None:
        if kernel_backend not in BACKENDS:
            raise ValueError(
                f"unknown kernel backend {kernel_backend!r}; valid backends are"
                f" {', '.join(BACKENDS)}"
            )
        self.model = model
        self.proposer = proposer
        self.verifier = verifier if verifier is not None else GreedyVerifier(kernel_backend)
        if temperature_policy is not None and not self.verifier.per_position_temperature:
            raise InputError(
                "a per-position temperature policy needs a verifier that samples at per-node "
                f"temperatures (verifier=rejection), not {type(self.verifier).__name__}"
            )
        self.stop_policy = stop_policy
        self.temperature_policy = temperature_policy
        self.kernel_backend = kernel_backend
        if head not in ("auto", "logits"):
            raise ValueError(f"head must be 'auto' or 'logits', got {head!r}")
        self.head = head
        self.max_cache_len = max_cache_len
        self._cache: RuntimeCache | None = None
        # set one to time each part of every step (bench --profile)
        self.profiler: StepProfiler | None = None

    def serves_plain_ar(self) -> bool:
        """Whether ``generate`` hands over to the plain autoregressive loop: nothing is drafted,
        greedy, no temperature policy and no profiler (the cost-aware default's plain decoding)."""
        return (
            type(self.proposer) is NullProposer
            and isinstance(self.verifier, GreedyVerifier)
            and self.temperature_policy is None
            and self.profiler is None
        )

    def _check_request(self, prompt_len: int, max_new_tokens: int) -> int:
        """The cache slots a request needs (prompt + ``max_new_tokens`` + one tree), after the
        checks plain decoding and the CLI make: the prompt must leave a position in the target's
        context (``max_new_tokens`` is already capped to it), the slots fit ``max_cache_len``."""
        cap_new_tokens(prompt_len, 0, self.model.sizes.context_length)
        needed = prompt_len + max_new_tokens + self.proposer.max_tree_nodes
        if self.max_cache_len is not None and needed > self.max_cache_len:
            raise InputError(
                f"prompt + max_new_tokens + draft tree need {needed} cache slots but the limit is"
                f" {self.max_cache_len} (max_cache_len); shorten the prompt, lower max_new_tokens"
                " or raise max_cache_len"
            )
        return needed

    def _cache_for(self, needed: int) -> RuntimeCache:
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
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` [P] (stop after any of
        ``eos_ids``).

        ``generator`` drives every random choice (sampling verifiers and sampling drafters);
        ``stream`` is called with each new chunk of tokens as soon as it is final.
        """
        prompt = _checked_prompt(prompt_ids, max_new_tokens)
        lossless = bool(self.verifier.lossless)
        if max_new_tokens == 0:
            return SpecResult([], 0, [], [], lossless)
        max_new_tokens = cap_new_tokens(
            prompt.numel(), max_new_tokens, self.model.sizes.context_length
        )
        if self.serves_plain_ar():
            return self._plain_greedy(prompt, max_new_tokens, eos_ids, stream)
        loop = self._start(prompt, max_new_tokens, eos_ids, generator, stream)
        done = loop.record.emit([loop.root])
        loop.context.append(loop.record.tokens)
        prof = self.profiler
        # fewer threads while other processes hold cores (see runtime/decoding/threads.py)
        threads = governor()
        while not done:
            threads.tick()
            with prof.step() if prof is not None else nullcontext():
                done = speculative_step(self, loop)
        return loop.record.result(lossless)

    def _start(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        eos_ids: Sequence[int],
        generator: torch.Generator | None,
        stream: Callable[[list[int]], None] | None,
    ) -> LoopState:
        """Prefill ``prompt`` and set up what every step of this generation reads and updates."""
        taps, cache, device = self._prepare(prompt, max_new_tokens)
        root, hidden_prev = self._prefill(
            prompt, cache, device, taps, generator
        )  # hidden_prev [H] produced the root
        prof = self.profiler
        return LoopState(
            cache=cache,
            device=device,
            taps=taps,
            generator=generator,
            greedy_head=self.uses_argmax_head(),
            part=prof.part if prof is not None else _no_part,
            # prompt + out, appended in place
            context=TokenBuffer(prompt, prompt.numel() + max_new_tokens),
            record=GenerationRecord(max_new_tokens, {int(e) for e in eos_ids}, stream),
            root=root,
            hidden_prev=hidden_prev,
        )

    def _prepare(
        self, prompt: torch.Tensor, max_new_tokens: int
    ) -> tuple[tuple[int, ...], RuntimeCache, torch.device]:
        """Per generation: reset a sequence-level temperature policy; the feature taps the proposer
        reads, a KV cache sized for prompt + ``max_new_tokens`` + one tree, and the model's
        device."""
        reset = getattr(self.temperature_policy, "reset", None)
        if callable(
            reset
        ):  # a sequence-level policy decides afresh from each prompt's last hidden state
            reset()
        taps = tuple(int(i) for i in self.proposer.feature_taps)
        cache = self._cache_for(self._check_request(prompt.numel(), max_new_tokens))
        return taps, cache, self.model.device

    def uses_argmax_head(self) -> bool:
        """Whether verification needs only the target's argmax per node: a greedy verifier that
        decides from it, a model whose forward can reduce its LM head to it (``argmax_head``), no
        temperature policy, and a proposer that declares ``reads_logits = False`` (its ``accept``
        never reads the accepted nodes' logits); never with ``head="logits"``."""
        return bool(
            self.head == "auto"
            and self.model.argmax_head
            and self.verifier.decides_from_argmax
            and self.temperature_policy is None
            and not self.proposer.reads_logits
        )

    def _prefill(
        self,
        prompt: torch.Tensor,
        cache: RuntimeCache,
        device: torch.device,
        taps: tuple[int, ...],
        generator: torch.Generator | None,
    ) -> tuple[int, torch.Tensor]:
        """Prefill ``prompt`` [P] into ``cache``, sample the root (the first generated token) and
        start the proposer; returns the root and the hidden state [H] whose logits produced it."""
        pre = self.model.forward(
            prompt.to(device), cache, logits_for="last", taps=taps
        )  # logits [1, V], hidden [P, H]
        cache.commit(prompt.numel())
        root = self.verifier.sample(pre.logits[-1], generator, **self.temperatures(pre.hidden[-1:]))
        self.proposer.begin(
            StepContext(
                tokens=torch.cat([prompt, prompt.new_tensor([root])]),
                root_token=root,
                hidden=pre.hidden,
                stop_policy=self.stop_policy,
                generator=generator,
                taps=pre.tap_features(taps),
                logits=pre.logits,
            )
        )
        return root, pre.hidden[-1]

    def _plain_greedy(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        eos_ids: Sequence[int],
        stream: Callable[[list[int]], None] | None,
    ) -> SpecResult:
        """Nothing is drafted (the cost-aware default chose plain decoding): the autoregressive loop
        gives the same greedy tokens without the speculative step's bookkeeping (which cost ~7% of a
        9 ms step on a 2-core CPU).
        """
        from draftsmith.runtime.decoding.autoregressive import generate_ar

        # The same request checks, without allocating the speculative cache that generate_ar does
        # not use.
        self._check_request(prompt.numel(), max_new_tokens)
        out = generate_ar(
            self.model,
            prompt.tolist(),
            max_new_tokens,
            eos_ids=eos_ids,
            stream=None if stream is None else (lambda token: stream([token])),
        )
        steps = max(0, len(out) - 1)  # one forward per token after the prefill's
        return SpecResult(out, steps, [0] * steps, [], True, [1] * steps, [0] * steps)

    def temperatures(self, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"temperature": [T]}`` from the temperature policy for target hidden rows [T, H]; {}
        without one."""
        if self.temperature_policy is None:
            return {}
        temps = torch.as_tensor(self.temperature_policy(hidden)).reshape(-1)  # [T]
        if temps.numel() != hidden.shape[0]:
            raise ValueError(
                f"the temperature policy returned {temps.numel()} temperatures for"
                f" {hidden.shape[0]} rows"
            )
        return {"temperature": temps}


def _checked_prompt(prompt_ids: torch.Tensor | Sequence[int], max_new_tokens: int) -> torch.Tensor:
    """The prompt as a flat CPU long tensor [P]; refuses an empty prompt and a negative
    ``max_new_tokens``."""
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().cpu()
    if prompt.numel() == 0:
        raise InputError("the prompt is empty: pass at least one token id (e.g. the BOS token)")
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    return prompt


def _no_part(name: str) -> nullcontext:
    """The part timer when no profiler is set."""
    return nullcontext()
