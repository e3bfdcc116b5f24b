"""Plain autoregressive decoding on any runtime decoder (batch 1), and token sampling."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from draftsmith.common.errors import InputError
from draftsmith.runtime.decoding.prompt_limits import cap_new_tokens
from draftsmith.runtime.decoding.threads import governor
from draftsmith.runtime.target.interface import RuntimeCache, TargetDecoder


def sample_token(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> int:
    """Pick a token from logits [V]: argmax when ``temperature == 0``, else nucleus sampling at
    ``temperature``."""
    if temperature <= 0.0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [V]
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        drop = sorted_p.cumsum(0) - sorted_p >= top_p
        probs = probs.scatter(0, order[drop], 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))


def _check_prompt(prompt_ids: list[int], vocab_size: int) -> None:
    if len(prompt_ids) == 0:
        raise InputError(
            "the prompt is empty: pass at least one token id (e.g. the BOS token or a chat"
            " template)"
        )
    if not all(0 <= t < vocab_size for t in prompt_ids):
        bad = [t for t in prompt_ids if not 0 <= t < vocab_size][:5]
        raise InputError(
            f"prompt token ids {bad} are outside the vocabulary [0, {vocab_size}); wrong tokenizer?"
        )


@torch.inference_mode()
def generate_ar(
    model: TargetDecoder,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_ids: Iterable[int] = (),
    generator: torch.Generator | None = None,
    stream: Callable[[int], None] | None = None,
    head: str = "auto",
) -> list[int]:
    """Decode up to ``max_new_tokens`` tokens after ``prompt_ids``, one target forward per token.

    Greedy when ``temperature == 0`` (token-identical to HF ``generate(do_sample=False)`` in fp32).
    Stops after an ``eos_ids`` token, which is included in the output like HF does. ``stream`` is
    called with each new token.
    ``head``: "auto" (greedy steps ask a target that declares ``argmax_head`` for the argmax only)
    or "logits". ``max_new_tokens`` past the target's context is capped to it with one warning line
    (:func:`~draftsmith.runtime.decoding.prompt_limits.cap_new_tokens`). Returns the new tokens
    only.
    """
    _check_request(prompt_ids, max_new_tokens, head, model.sizes.vocab_size)
    eos = set(eos_ids)
    if max_new_tokens == 0:
        return []
    max_new_tokens = cap_new_tokens(len(prompt_ids), max_new_tokens, model.sizes.context_length)
    cache, logits = _prefill(model, prompt_ids, max_new_tokens)
    out: list[int] = []
    step = torch.empty(1, dtype=torch.long, device=model.device)  # reused input buffer
    # Greedy steps need only the argmax: a model that can reduce its LM head to it skips the [1, V]
    # logits.
    greedy = temperature <= 0.0 and head == "auto" and model.argmax_head
    # fewer threads while other processes hold cores (see runtime/decoding/threads.py)
    threads = governor()
    tok = sample_token(logits[-1], temperature, top_p, generator)
    while True:
        threads.tick()
        out.append(tok)
        if stream is not None:
            stream(tok)
        if tok in eos or len(out) >= max_new_tokens:
            return out
        step.fill_(tok)
        tok = _next_token(model, step, cache, greedy, temperature, top_p, generator)
        cache.commit(1)


def _check_request(prompt_ids: list[int], max_new_tokens: int, head: str, vocab_size: int) -> None:
    """Refuse a negative ``max_new_tokens``, an unknown ``head`` and a prompt outside the
    vocabulary."""
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if head not in ("auto", "logits"):
        raise ValueError(f"head must be 'auto' or 'logits', got {head!r}")
    _check_prompt(prompt_ids, vocab_size)


def _prefill(
    model: TargetDecoder, prompt_ids: list[int], max_new_tokens: int
) -> tuple[RuntimeCache, torch.Tensor]:
    """A cache for prompt + ``max_new_tokens`` with the prompt committed, and its last logits
    [1, V]."""
    cache = model.allocate_cache(len(prompt_ids) + max_new_tokens)
    logits = model.forward(
        torch.tensor(prompt_ids, dtype=torch.long, device=model.device), cache, logits_for="last"
    ).logits
    cache.commit(len(prompt_ids))
    return cache, logits


def _next_token(
    model: TargetDecoder,
    step: torch.Tensor,
    cache: RuntimeCache,
    greedy: bool,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> int:
    """Run the last token ``step`` [1] and pick the next (the argmax head when ``greedy``)."""
    if greedy:
        return int(model.forward(step, cache, logits_for="last", head="argmax").argmax[0])
    return sample_token(
        model.forward(step, cache, logits_for="last").logits[-1],
        temperature,
        top_p,
        generator,
    )
