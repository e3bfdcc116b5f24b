"""Greedy decoding of several prompts at once on the lean decoder, for ``draftsmith regenerate --batch-size N``.

A 135M target at batch 1 is memory-bound: each step reads every weight to make one token. Decoding ``N`` rows per
step reads the weights once for ``N`` tokens. The lean decoder serves one request (its cache and fused C++ layer are
batch 1), so this module runs its weights through a batched step of its own:

- **Ragged static KV cache** ``[L, B, Hkv, S, d]``: row ``b`` holds ``lengths[b]`` committed slots, no padding. A
  row's prompt is prefilled by the decoder's own forward into views of that row, so each first token is the one
  :func:`draftsmith.runtime.decoding.autoregressive.generate_ar` picks. Each step then writes one K/V per row at
  that row's length, at that row's position, and attends under a mask of the row's own slots.
- **Slots refill:** a row that stops (EOS / stop id / its token budget) takes the next prompt of the list, so the
  batch stays full until the list runs dry. Which prompt runs in which row at which step depends only on the list,
  ``batch_size`` and the tokens generated, so a rerun on the same list gives the same tokens.
- On the fused C++ stack (bf16 on x86) the whole step is one native call, ``TargetStack.forward_rows``: every layer
  with each row's K/V written at its own slot and attention over its own cache, the final norm and the head's argmax.
  It runs batch-1 decoding's kernels, so its replies equal batch-1 ``generate_ar`` bit for bit
  (tests/test_cpu_stack.py). On the 2-core Zen 4, 8 rows at context 300 took 14.7 ms a step (9.6 ms for 1 row)
  against 27.4 ms for the per-layer torch step below, and regeneration ran at ~320 tokens/s against ~200.
- Elsewhere (fp32, the torch or oneDNN linears) the per-layer torch step below runs; in fp32 it matches batch-1
  decoding token for token (tests/test_batched_regenerate.py). In bf16 its ops round unlike the fused layer's, and a
  greedy reply that meets a near-tie goes on differently from there: 6-7 of the first 16 embedded ShareGPT replies
  (256 tokens) were identical. Both are the target's own greedy text, which is what self-distillation asks for.

Supported: the plain Llama layer (Llama, SmolLM, Qwen2/3, Mistral without a window, Phi-3). :func:`batch_support`
says why another decoder (a family layer, the HF fallback, a compiled forward) decodes one prompt at a time.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from draftsmith.runtime.decoding.threads import governor
from draftsmith.runtime.target.cache import CacheFullError
from draftsmith.runtime.target.linear_ops import PackedLinear
from draftsmith.runtime.target.model import LeanDecoder
from draftsmith.runtime.target.torch_layers import qk_rope_v

Tensor = torch.Tensor
_LAYER_OPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> (ops, weights) of the batched step


def batch_support(model: object) -> str | None:
    """Why ``model`` cannot decode a batch with :func:`generate_greedy_batch` (None: it can)."""
    if type(model) is not LeanDecoder:  # noqa: E721 - a FamilyDecoder subclass runs other layers
        return f"the {type(model).__name__} decoder has no batched step (the plain lean Llama layer has)"
    if getattr(model, "_compiled", None) is not None:
        return "the decoder is compiled (torch.compile)"
    if model.config.sliding_window is not None:
        return "the model has a sliding window"
    return None


class _RowCache:
    """Batch-1 cache interface over row ``b`` of the batched cache: the decoder's own forward prefills into it."""

    def __init__(self, k: Tensor, v: Tensor, row: int) -> None:
        self.layers = list(zip(k[:, row].unbind(0), v[:, row].unbind(0)))  # per-layer [Hkv, S, d] views
        self.max_len = k.shape[3]
        self.length = 0

    def check_fits(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.max_len:
            raise CacheFullError(f"{new_tokens} new tokens do not fit in a {self.max_len}-slot batch row")


def _linear_add(ops: type, x: Tensor, w: Tensor, b: Tensor | None, res: Tensor) -> Tensor:
    """res + x @ w.T (+ b) in the decoder's linear backend (the fused backend's ``pack_res`` equals its ``pack``)."""
    if ops.linear_add is not None:
        return ops.linear_add(x, w, b, res)
    return res + ops.linear(x, w, b)


def _batched_layer(ops: type, weights: tuple, x: Tensor, kc: Tensor, vc: Tensor, rows: Tensor, slots: Tensor,
                   cos: Tensor, sin: Tensor, mask: Tensor, hq: int, hkv: int, eps: float, scale: float) -> Tensor:
    """One Llama layer for one new token per row: x [b, H] -> [b, H]; K/V written at ``kc[rows, :, slots]``.

    ``kc``/``vc`` [b, Hkv, S', d] (this step's row range and slot window), ``mask`` [b, 1, 1, S'] the row's own
    slots, cos/sin [b, 1, d] at each row's position. Same ops as ``torch_layers.llama_layer`` with T=1 per row.
    """
    ln1, wqkv, bqkv, qn, kn, wo, bo, ln2, wgu, bgu, wdown, bdown = weights
    n, d = x.shape[0], kc.shape[-1]
    nq, hshape = hq * d, x.shape[1:]
    qk, v = qk_rope_v(ops.linear, x, ln1, wqkv, bqkv, qn, kn, cos, sin, hq, hkv, d, eps)  # [b, Hq+Hkv, d], [b, Hkv, d]
    kc[rows, :, slots] = qk[:, hq:]  # [b, Hkv, d] into each row's next slot
    vc[rows, :, slots] = v
    # GQA without repeating K/V: the query heads of one kv head are its G query rows (as tree_attention does)
    qg = qk[:, :hq].reshape(n, hkv, hq // hkv, d)  # [b, Hkv, G, d]
    attn = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=mask, scale=scale)  # [b, Hkv, G, d]
    x = _linear_add(ops, attn.reshape(n, nq), wo, bo, x)  # [b, H]
    gu = ops.linear(F.rms_norm(x, hshape, ln2, eps), wgu, bgu)  # [b, 2I]
    inter = gu.shape[1] // 2
    return _linear_add(ops, F.silu(gu[:, :inter]) * gu[:, inter:], wdown, bdown, x)  # [b, H]


def _layer_ops(model: LeanDecoder) -> tuple[type, list[tuple]]:
    """The linear ops and per-layer weights of the batched step (made once per decoder): the decoder's own. The fused
    C++ backend's ``linear`` needs each packed weight's true output size beside it (packing pads rows to 16).

    oneDNN's bf16 linears (a second, prepacked copy of the weights) were tried on the 2-core Zen 4: faster for a
    lone step, not in the regeneration loop (65-78 against 66-101 tokens/s at batch 8, 3 interleaved rounds under
    load), so the C++ linears stay.
    """
    if model in _LAYER_OPS:
        return _LAYER_OPS[model]
    ops, weights = model._ops, list(model._exec)
    if ops.name == "cpp":
        c = model.config
        sizes = {1: (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, 5: c.hidden_size, 8: 2 * c.intermediate_size,
                 10: c.hidden_size}  # tuple slot -> out features of wqkv, wo, wgu, wdown
        weights = [tuple(PackedLinear(w, sizes[j]) if j in sizes else w for j, w in enumerate(layer))
                   for layer in weights]
    _LAYER_OPS[model] = ops, weights
    return ops, weights


def _step(model: LeanDecoder, ops: type, weights: list[tuple], k: Tensor, v: Tensor, tokens: Tensor, lengths: Tensor,
          lo: int, hi: int) -> Tensor:
    """Feed ``tokens[lo:hi]`` (one per row) at slots ``lengths[lo:hi]``; returns each row's greedy next token."""
    c = model.config
    pos = lengths[lo:hi]  # [b]: a row's next slot is its position (no padding)
    stack = getattr(model, "_stack", None)
    if stack is not None:  # the fused C++ stack: every layer, the final norm and the head's argmax in one call
        x = F.embedding(tokens[lo:hi], model.embed)  # [b, H]
        cos, sin = (t[pos].reshape(hi - lo, -1).contiguous() for t in (model._cos, model._sin))  # [b, d]
        return stack.stack.forward_rows(x.contiguous(), k, v, lo, pos.contiguous(), cos, sin)  # [b]
    window = int(pos.max()) + 1  # attend over the slots any row of the range uses
    rows = torch.arange(hi - lo, device=pos.device)
    mask = (torch.arange(window, device=pos.device)[None, :] <= pos[:, None])[:, None, None, :]  # [b, 1, 1, S']
    cos, sin = model._cos[pos], model._sin[pos]  # [b, 1, d]
    x = F.embedding(tokens[lo:hi], model.embed)  # [b, H]
    for i, layer in enumerate(weights):
        kc, vc = k[i, lo:hi, :, :window], v[i, lo:hi, :, :window]  # [b, Hkv, S', d] views
        x = _batched_layer(ops, layer, x, kc, vc, rows, pos, cos, sin, mask, c.num_heads,
                           c.num_kv_heads, c.rms_norm_eps, c.head_dim**-0.5)  # [b, H]
    hidden = F.rms_norm(x, (c.hidden_size,), model.norm_w, c.rms_norm_eps)  # [b, H]
    return model._ops.argmax(hidden, model._head, None)  # [b]: no [b, V] logits


@torch.inference_mode()
def generate_greedy_batch(
    model: LeanDecoder, prompts: Sequence[list[int]], budgets: Sequence[int], eos_ids: Iterable[int] = (),
    batch_size: int = 8, done: Callable[[int, list[int]], None] | None = None,
) -> list[list[int]]:
    """Greedy replies to ``prompts`` (each at most ``budgets[i]`` tokens, an EOS / stop id included like
    ``generate_ar``), ``batch_size`` rows decoding at once; returns the new tokens of each prompt, in order.

    ``done(i, tokens)`` is called as soon as prompt ``i`` finishes (not in order). Raises ValueError for a decoder
    without a batched step (:func:`batch_support`), an empty prompt or a budget below 1.
    """
    why = batch_support(model)
    if why is not None:
        raise ValueError(f"batched decoding is unavailable: {why}")
    if batch_size < 1 or len(prompts) != len(budgets):
        raise ValueError(f"need batch_size >= 1 and one budget per prompt; got {batch_size}, "
                         f"{len(prompts)} prompts, {len(budgets)} budgets")
    if any(len(p) == 0 for p in prompts) or any(b < 1 for b in budgets):
        raise ValueError("every prompt needs at least one token and every budget at least 1")
    if not prompts:
        return []
    return _Batch(model, prompts, budgets, set(eos_ids), min(batch_size, len(prompts)), done).run()


class _Batch:
    """The rows of one :func:`generate_greedy_batch` call: which prompt each decodes, its cache, its last token."""

    def __init__(self, model: LeanDecoder, prompts: Sequence[list[int]], budgets: Sequence[int], eos: set[int],
                 rows: int, done: Callable[[int, list[int]], None] | None) -> None:
        c, dev = model.config, model.device
        self.model, self.prompts, self.budgets, self.eos, self.done = model, prompts, budgets, eos, done
        span = max(len(p) + b for p, b in zip(prompts, budgets))  # any prompt may land in any row
        model._ensure_rope(span)
        shape = (c.num_layers, rows, c.num_kv_heads, span, c.head_dim)
        self.k = torch.zeros(shape, dtype=model.dtype, device=dev)  # [L, B, Hkv, S, d]
        self.v = torch.zeros(shape, dtype=model.dtype, device=dev)
        self.owner = [-1] * rows  # the prompt each row decodes (-1: idle)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=dev)  # [B] each row's last token
        self.lengths = torch.zeros(rows, dtype=torch.long, device=dev)  # [B] committed slots per row
        self.results: list[list[int]] = [[] for _ in prompts]
        self.queue = iter(range(len(prompts)))

    def start(self, row: int) -> None:
        """Give ``row`` the next prompts until one needs more than its first token (or none is left)."""
        self.owner[row] = -1
        for i in self.queue:
            ids = torch.tensor(self.prompts[i], dtype=torch.long, device=self.model.device)  # [T]
            logits = self.model.forward(ids, _RowCache(self.k, self.v, row), logits_for="last").logits  # [1, V]
            if self.append(i, int(logits[-1].argmax())):  # the prefill and first pick generate_ar makes
                self.owner[row], self.lengths[row], self.tokens[row] = i, len(self.prompts[i]), self.results[i][-1]
                return

    def append(self, i: int, tok: int) -> bool:
        """Record ``tok`` for prompt ``i``; False once the prompt is finished (and ``done`` was told)."""
        self.results[i].append(tok)
        if tok in self.eos or len(self.results[i]) >= self.budgets[i]:
            if self.done is not None:
                self.done(i, self.results[i])
            return False
        return True

    def run(self) -> list[list[int]]:
        """Decode until every prompt is finished; rows refill from the queue as they free up."""
        ops, weights = _layer_ops(self.model)
        threads = governor()  # fewer threads while other processes hold cores, as generate_ar does
        for row in range(len(self.owner)):
            self.start(row)
        while any(o >= 0 for o in self.owner):
            threads.tick()
            busy = [r for r, o in enumerate(self.owner) if o >= 0]
            lo, hi = busy[0], busy[-1] + 1  # a contiguous row range: views, no gather of the cache
            nxt = _step(self.model, ops, weights, self.k, self.v, self.tokens, self.lengths, lo, hi).tolist()
            for r in range(lo, hi):
                if self.owner[r] < 0:
                    continue  # an idle row inside the range: its output is ignored
                self.lengths[r] += 1
                self.tokens[r] = nxt[r - lo]
                if not self.append(self.owner[r], nxt[r - lo]):
                    self.start(r)
        return self.results


__all__ = ["batch_support", "generate_greedy_batch"]
