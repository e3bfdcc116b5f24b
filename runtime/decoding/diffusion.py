"""Semi-autoregressive block decoding for block-diffusion LMs: the low-confidence-remasking
baseline, the Learn2PD loop (filter-accepted positions + the baseline's k per step), End-of-Text
Prediction, an optional prefix KV cache.

Per block of ``L`` masked slots (LLaDA ``generate``): each step scores the block once, takes ``x0 =
argmax`` (with Gumbel noise at T > 0) and its confidence ``softmax(logits)[x0]``, and a *policy*
picks the masked slots to commit; committed tokens never change. The baseline commits the ``k_i``
most confident masked slots (``k_i`` from spreading the block's masks evenly over
``steps_per_block``); a policy may commit more, never fewer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from draftsmith.common.errors import InputError
from draftsmith.runtime.target.diffusion_lm import (
    DiffusionLM,
    block_ids,
    prompt_offset,
    supports_prefix_cache,
)

# policy(step, masked [L] bool, x0 [L], conf [L], k) -> commit [L] bool (a superset of the top-k for
# Learn2PD)
Policy = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass
class DiffusionDecodeConfig:
    """Knobs of one decode (the bench and the oracle share them)."""

    gen_length: int = 256
    # block_length / steps_per_block tokens per step for the baseline (1 at 32/32)
    steps_per_block: int = 32
    temperature: float = 0.0
    use_cache: bool = False  # prefix KV cache across finished blocks (one extra forward per block)
    # End-of-Text Prediction: cut the answer at a predicted EoT, skip the blocks after it
    eotp: bool = False
    # stop after a finished block holds an EoT (plain early exit, no prediction)
    stop_at_eot: bool = False
    seed: int = 0


@dataclass
class DecodeResult:
    """A decoded answer and what it cost."""

    tokens: list[int]  # the generated slots as decoded (EoT padding included)
    answer: list[int]  # up to (not including) the first EoT
    steps: int  # denoising steps (block scorings) over all blocks
    forwards: int  # model forwards, cache commits included
    block_steps: list[int] = field(default_factory=list)
    seconds: float = 0.0
    truncated_at: int | None = None  # EoTP cut (index into ``tokens``), if any


def transfer_schedule(masked: int, steps: int) -> list[int]:
    """LLaDA's ``num_transfer_tokens``: ``masked`` slots spread over ``steps`` steps, the remainder
    first."""
    steps = max(1, min(steps, masked)) if masked else 1
    base, extra = divmod(masked, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


def top_k_masked(masked: torch.Tensor, conf: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` most confident masked slots (bool [L])."""
    out = torch.zeros_like(masked)
    k = min(k, int(masked.sum()))
    if k > 0:
        out[torch.where(masked, conf, torch.full_like(conf, -1.0)).topk(k).indices] = True
    return out


def baseline_policy(
    step: int, masked: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor, k: int
) -> torch.Tensor:
    """Low-confidence remasking: commit the ``k`` most confident masked slots."""
    return top_k_masked(masked, conf, k)


def filter_policy(accept: Callable[[torch.Tensor], torch.Tensor]) -> Policy:
    """Learn2PD: the baseline's top-k plus every masked slot ``accept(conf [L]) -> bool [L]``
    accepts."""

    def policy(
        step: int, masked: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor, k: int
    ) -> torch.Tensor:
        return top_k_masked(masked, conf, k) | (accept(conf) & masked)

    return policy


def eotp_cut(
    commit: torch.Tensor,
    masked: torch.Tensor,
    x0: torch.Tensor,
    conf: torch.Tensor,
    eos: torch.Tensor,
) -> tuple[int | None, bool]:
    """EoTP's cut in a block: ``(slot, committed)``. The first committed EoT when one is committed
    this step; otherwise the most confident still-masked slot predicting EoT (not committed);
    ``(None, False)`` if neither.
    """
    is_eot = torch.isin(x0, eos)
    hit = (commit & is_eot).nonzero()
    if len(hit):
        return int(hit[0]), True
    pending = masked & ~commit & is_eot
    if pending.any():
        return int(torch.where(pending, conf, torch.full_like(conf, -1.0)).argmax()), False
    return None, False


def score(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x0`` and its confidence ``softmax(logits)[x0]`` for logits [L, V]; Gumbel-max sampling at T
    > 0."""
    if temperature > 0:
        u = torch.rand(
            logits.shape, generator=generator, device=logits.device, dtype=torch.float64
        ).clamp_(1e-20, 1)
        x0 = (logits.double() / temperature - torch.log(-torch.log(u))).argmax(-1)
    else:
        x0 = logits.argmax(-1)
    conf = torch.softmax(logits.float(), -1).gather(-1, x0[:, None])[:, 0]  # [L]
    return x0, conf


def check_fits(prompt_len: int, gen_length: int, context: int) -> None:
    """Refuse a prompt whose answer slots would run past the target's context, before any
    forward."""
    if prompt_len < 1:
        raise InputError(
            "the prompt is empty: a block-diffusion decode needs at least one prompt token"
        )
    if prompt_len + gen_length > context:
        raise InputError(
            f"the prompt has {prompt_len} tokens and {gen_length} answer slots follow, but the"
            f" target's context is {context} positions; shorten the prompt to at most"
            f" {context - gen_length} tokens or lower the generation length"
        )


@torch.no_grad()
def diffusion_decode(
    lm: DiffusionLM,
    prompt: list[int] | torch.Tensor,
    cfg: DiffusionDecodeConfig,
    policy: Policy = baseline_policy,
    observe: Callable[..., None] | None = None,
) -> DecodeResult:
    """Decode ``cfg.gen_length`` slots after ``prompt`` block by block with ``policy`` (batch 1).

    ``observe(block, step, masked, x0, conf, canvas)`` sees every step (the oracle records
    trajectories with it); ``canvas`` [L] is the block, and writing into it replaces tokens (the
    oracle's anti-stall copy).
    """
    L = lm.spec.block_length
    _check_decodable(lm, cfg)
    prompt = torch.as_tensor(prompt, dtype=torch.long, device=lm.device).reshape(-1)
    check_fits(len(prompt), cfg.gen_length, lm.context)
    start_time, forwards0 = time.perf_counter(), lm.forwards
    generator = (
        torch.Generator(device=lm.device).manual_seed(cfg.seed) if cfg.temperature > 0 else None
    )
    eos = torch.tensor(lm.eos_ids(), device=lm.device)
    run = _BlockRun(lm, cfg, policy, observe, eos, generator, prompt_offset(len(prompt), L))
    seq = prompt.clone()  # prompt + finished blocks
    cache, last_logits = None, None
    if cfg.use_cache:
        logits, cache = lm.forward(
            seq[None], block_ids(len(seq), L, run.offset, lm.device)[None], commit=True
        )
        last_logits = logits[0, -1]  # [V]: scores the first slot of the next block
    block_steps: list[int] = []
    truncated_at = None
    for b in range(cfg.gen_length // L):
        canvas, steps, cut = _decode_block(run, b, seq, cache, last_logits)
        block_steps.append(steps)
        seq = torch.cat([seq, canvas])
        if cut is not None:
            truncated_at = b * L + cut
            break
        if cfg.stop_at_eot and bool(torch.isin(canvas, eos).any()):
            break
        if cache is not None and b + 1 < cfg.gen_length // L:
            blocks = block_ids(len(seq), L, run.offset, lm.device)[None]
            logits, cache = lm.forward(
                canvas[None], blocks[:, -L:], cache, past_blocks=blocks[:, :-L], commit=True
            )
            last_logits = logits[0, -1]
    tokens = seq[len(prompt) :].tolist()
    ends = [i for i, t in enumerate(tokens) if t in set(eos.tolist())]
    return DecodeResult(
        tokens=tokens,
        answer=tokens[: ends[0]] if ends else tokens,
        steps=sum(block_steps),
        forwards=lm.forwards - forwards0,
        block_steps=block_steps,
        seconds=time.perf_counter() - start_time,
        truncated_at=truncated_at,
    )


@dataclass
class _BlockRun:
    """What every block of one :func:`diffusion_decode` call reads."""

    lm: DiffusionLM
    cfg: DiffusionDecodeConfig
    policy: Policy
    observe: Callable[..., None] | None
    eos: torch.Tensor  # [E] end-of-text ids
    generator: torch.Generator | None  # Gumbel noise at T > 0
    offset: int  # prompt_offset: where the first block starts


def _decode_block(
    run: _BlockRun, b: int, seq: torch.Tensor, cache: Any, last_logits: torch.Tensor | None
) -> tuple[torch.Tensor, int, int | None]:
    """Unmask block ``b`` after ``seq`` (prompt + finished blocks): -> (the block [L], the steps
    it took, the slot End-of-Text Prediction cut it at or None)."""
    lm, cfg = run.lm, run.cfg
    L, mask_id = lm.spec.block_length, lm.spec.mask_token_id
    canvas = torch.full((L,), mask_id, dtype=torch.long, device=lm.device)
    schedule = transfer_schedule(L, cfg.steps_per_block)
    # LLaDA/Dream also see later masks
    later = cfg.gen_length - (b + 1) * L if lm.spec.attention == "full" else 0
    cut, step = None, 0
    while bool((canvas == mask_id).any()):
        masked = canvas == mask_id
        slot_logits = _block_slot_logits(lm, seq, canvas, later, run.offset, cache, last_logits)
        x0, conf = score(slot_logits, cfg.temperature, run.generator)
        if run.observe is not None:
            run.observe(b, step, masked, x0, conf, canvas)
            masked = canvas == mask_id  # the observer may have filled slots
        k = schedule[min(step, len(schedule) - 1)]
        commit = run.policy(step, masked, x0, conf, k) & masked
        if cfg.eotp and cut is None:
            cut = _cut_at_predicted_end(canvas, commit, masked, x0, conf, run.eos)
        canvas[commit] = x0[commit]
        step += 1
        if step > 4 * L:  # a policy that never commits would loop forever
            raise RuntimeError(
                f"block {b} is still masked after {step} steps: the policy commits nothing"
            )
    return canvas, step, cut


def _cut_at_predicted_end(
    canvas: torch.Tensor,
    commit: torch.Tensor,
    masked: torch.Tensor,
    x0: torch.Tensor,
    conf: torch.Tensor,
    eos: torch.Tensor,
) -> int | None:
    """End-of-Text Prediction for one step: the slot where the answer ends (:func:`eotp_cut`), or
    None; on a cut the canvas after it is padded with that EoT and nothing after it is committed
    (``canvas``, ``commit`` edited).
    """
    cut, _ = eotp_cut(commit, masked, x0, conf, eos)
    if cut is not None:
        canvas[cut + 1 :] = int(x0[cut])  # everything after the end would decode to EoT: pad it now
        commit[cut + 1 :] = False
    return cut


def _check_decodable(lm: DiffusionLM, cfg: DiffusionDecodeConfig) -> None:
    """Refuse a config the target cannot decode: the prefix cache on a target without one, or a
    generation length that is not a whole number of blocks."""
    L = lm.spec.block_length
    full_attention = lm.spec.attention == "full"
    if cfg.use_cache and not supports_prefix_cache(lm.spec):
        raise InputError(
            "the prefix cache needs a shifted block-causal target (recipe=diffusion_adapt); this"
            " one "
            + ("attends to the whole canvas (LLaDA, Dream)" if full_attention else "has no shift")
            + ": decode with the cache off"
        )
    if cfg.gen_length % L:
        raise InputError(f"gen_length {cfg.gen_length} is not a multiple of the block length {L}")


def _block_slot_logits(
    lm: DiffusionLM,
    seq: torch.Tensor,
    canvas: torch.Tensor,
    later: int,
    offset: int,
    cache: Any,
    last_logits: torch.Tensor | None,
) -> torch.Tensor:
    """Logits [L, V] for the block's ``L`` slots, the mask token ruled out: one forward over prompt
    + finished blocks
    + ``canvas`` (+ ``later`` masked slots a full-attention target also sees), or, with the prefix
      ``cache``, over
    the canvas alone (``last_logits`` scoring its first slot)."""
    L, mask_id = lm.spec.block_length, lm.spec.mask_token_id
    if cache is None:
        full = torch.cat([seq, canvas, canvas.new_full((later,), mask_id)])[
            None
        ]  # [1, P + bL + L + later]
        logits, _ = lm.forward(full, block_ids(full.shape[1], L, offset, lm.device)[None])
        first = len(seq) - 1 if lm.spec.shift else len(seq)  # shift: position i scores slot i+1
        slot_logits = logits[0, first : first + L]  # [L, V]
    else:
        blocks = block_ids(len(seq) + L, L, offset, lm.device)[None]
        logits, _ = lm.forward(
            canvas[None], blocks[:, len(seq) :], cache, past_blocks=blocks[:, : len(seq)]
        )
        slot_logits = torch.cat([last_logits[None], logits[0, :-1]])  # [L, V]
    slot_logits[:, mask_id] = float(
        "-inf"
    )  # never "predict" the mask itself: the slot would stay masked
    return slot_logits


def learn2pd_policy(filter_module: Any, threshold: float | None = None) -> Policy:
    """The Learn2PD policy for a loaded ``controllers.learn2pd.Learn2PDFilter`` (its exported
    threshold unless ``threshold`` is given)."""
    thr = float(filter_module.config.threshold if threshold is None else threshold)

    def accept(conf: torch.Tensor) -> torch.Tensor:
        return filter_module.accept(conf[None].float(), thr)[0]

    return filter_policy(accept)


__all__ = [
    "DecodeResult",
    "DiffusionDecodeConfig",
    "baseline_policy",
    "check_fits",
    "diffusion_decode",
    "eotp_cut",
    "filter_policy",
    "learn2pd_policy",
    "score",
    "top_k_masked",
    "transfer_schedule",
]
