"""Greedy decoding of several prompts at once, for ``draftsmith regenerate --batch-size N``: the
scheduling of rows.

A 135M target at batch 1 is memory-bound: each step reads every weight to make one token; ``N`` rows
per step read the weights once for ``N`` tokens. The decode step itself is the runtime's
(:meth:`~draftsmith.runtime.target.interface.TargetDecoder.decode_rows` over a ragged
:class:`~draftsmith.runtime.target.rows.RowsCache`, see :mod:`draftsmith.runtime.target.rows`); this
module decides which prompt runs in which row:

- a row's prompt is prefilled by the target's own batch-1 forward into that row (``RowsCache.row``),
  so each first token is the one :func:`draftsmith.runtime.decoding.autoregressive.generate_ar`
  picks;
- **slots refill:** a row that stops (EOS / stop id / its token budget) takes the next prompt of the
  list, so the batch stays full until the list runs dry. Which prompt runs in which row at which
  step depends only on the list, ``batch_size`` and the tokens generated, so a rerun on the same
  list gives the same tokens.

On the fused C++ stack (bf16 on x86) the replies equal batch-1 ``generate_ar`` bit for bit
(tests/test_cpu_stack.py); elsewhere in fp32 token for token (tests/test_batched_regenerate.py). On
the 2-core Zen 4, 8 rows at context 300 took 14.7 ms a step (9.6 ms for 1 row) against 27.4 ms for
the per-layer torch step, and regeneration ran at ~320 tokens/s against ~200. Supported: the plain
Llama layer (Llama, SmolLM, Qwen2/3, Mistral without a window, Phi-3); :func:`batch_support` says
why another target (a family layer, the HF fallback, a compiled forward) decodes one prompt at a
time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from draftsmith.runtime.decoding.threads import governor
from draftsmith.runtime.target.interface import TargetDecoder


def batch_support(model: TargetDecoder) -> str | None:
    """Why ``model`` cannot decode a batch with :func:`generate_greedy_batch` (None: it can)."""
    return model.rows_refusal()


@torch.inference_mode()
def generate_greedy_batch(
    model: TargetDecoder,
    prompts: Sequence[list[int]],
    budgets: Sequence[int],
    eos_ids: Iterable[int] = (),
    batch_size: int = 8,
    done: Callable[[int, list[int]], None] | None = None,
) -> list[list[int]]:
    """Greedy replies to ``prompts`` (each at most ``budgets[i]`` tokens, an EOS / stop id included
    like ``generate_ar``), ``batch_size`` rows decoding at once; returns the new tokens of each
    prompt, in order.

    ``done(i, tokens)`` is called as soon as prompt ``i`` finishes (not in order). Raises ValueError
    for a decoder without a batched step (:func:`batch_support`), an empty prompt or a budget below
    1.
    """
    why = batch_support(model)
    if why is not None:
        raise ValueError(f"batched decoding is unavailable: {why}")
    if batch_size < 1 or len(prompts) != len(budgets):
        raise ValueError(
            f"need batch_size >= 1 and one budget per prompt; got {batch_size}, "
            f"{len(prompts)} prompts, {len(budgets)} budgets"
        )
    if any(len(p) == 0 for p in prompts) or any(b < 1 for b in budgets):
        raise ValueError("every prompt needs at least one token and every budget at least 1")
    if not prompts:
        return []
    return _Batch(model, prompts, budgets, set(eos_ids), min(batch_size, len(prompts)), done).run()


class _Batch:
    """The rows of one :func:`generate_greedy_batch` call: which prompt each decodes, its cache, its
    last token."""

    def __init__(
        self,
        model: TargetDecoder,
        prompts: Sequence[list[int]],
        budgets: Sequence[int],
        eos: set[int],
        rows: int,
        done: Callable[[int, list[int]], None] | None,
    ) -> None:
        self.model, self.prompts, self.budgets, self.eos, self.done = (
            model,
            prompts,
            budgets,
            eos,
            done,
        )
        span = max(len(p) + b for p, b in zip(prompts, budgets))  # any prompt may land in any row
        self.cache = model.allocate_rows(rows, span)  # K/V [L, B, Hkv, S, d], lengths [B]
        self.owner = [-1] * rows  # the prompt each row decodes (-1: idle)
        self.tokens = torch.zeros(
            rows, dtype=torch.long, device=model.device
        )  # [B] each row's last token
        self.results: list[list[int]] = [[] for _ in prompts]
        self.queue = iter(range(len(prompts)))

    def start(self, row: int) -> None:
        """Give ``row`` the next prompts until one needs more than its first token (or none is
        left)."""
        self.owner[row] = -1
        for i in self.queue:
            ids = torch.tensor(self.prompts[i], dtype=torch.long, device=self.model.device)  # [T]
            logits = self.model.forward(
                ids, self.cache.row(row), logits_for="last"
            ).logits  # [1, V]
            if self.append(
                i, int(logits[-1].argmax())
            ):  # the prefill and first pick generate_ar makes
                self.owner[row], self.cache.lengths[row], self.tokens[row] = (
                    i,
                    len(ids),
                    self.results[i][-1],
                )
                return

    def append(self, i: int, tok: int) -> bool:
        """Record ``tok`` for prompt ``i``; False once the prompt is finished (and ``done`` was
        told)."""
        self.results[i].append(tok)
        if tok in self.eos or len(self.results[i]) >= self.budgets[i]:
            if self.done is not None:
                self.done(i, self.results[i])
            return False
        return True

    def run(self) -> list[list[int]]:
        """Decode until every prompt is finished; rows refill from the queue as they free up."""
        threads = governor()  # fewer threads while other processes hold cores, as generate_ar does
        for row in range(len(self.owner)):
            self.start(row)
        while any(o >= 0 for o in self.owner):
            threads.tick()
            busy = [r for r, o in enumerate(self.owner) if o >= 0]
            lo, hi = busy[0], busy[-1] + 1  # a contiguous row range: views, no gather of the cache
            nxt = self.model.decode_rows(self.tokens, self.cache, lo, hi).tolist()
            for r in range(lo, hi):
                if self.owner[r] < 0:
                    continue  # an idle row inside the range: its output is ignored
                self.cache.lengths[r] += 1
                self.tokens[r] = nxt[r - lo]
                if not self.append(self.owner[r], nxt[r - lo]):
                    self.start(r)
        return self.results


__all__ = ["batch_support", "generate_greedy_batch"]
