"""Training-throughput benchmark: tokens/s of a recipe's training step next to the target's forward alone.

The ratio ``train tokens/s / target-forward tokens/s`` says how much the drafter costs on top of the frozen
target. Both are measured in the same process on the same batches, after warm-up steps.

``drafter_only_tokens_per_s`` is the step as training from a feature cache runs it (``data.features=DIR``): the target's
features computed beforehand (outside the timer), the teacher logits rebuilt from the cached final hidden state with the
LM head as :class:`~draftsmith.distill.feature_cache.cached_data.CachedTarget` does, then the drafter's forward,
backward and optimizer step. ``cache_speedup`` = drafter-only / online tokens/s: what every epoch and every recipe
variant after the first gains by training from the cache.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import time
from typing import Any

import torch

from draftsmith.distill.engine.module import DistillModule
from draftsmith.distill.target.frozen import Target


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def sample_batches(target: Target, cfg: Any, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` full rows of real chat data ([B, max_length], packed so no padding skews the count)."""
    from draftsmith.distill.data.datamodule import build_datamodule

    data = build_datamodule(cfg, target.tokenizer, packing=True)
    data.setup("fit")
    batches = []
    for batch in data.train_dataloader():
        batches.append(batch)
        if len(batches) == count:
            break
    if len(batches) < count:
        raise ValueError(f"only {len(batches)} batches of data; raise data.limit")
    return batches


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _timed(fn, batches: list[dict[str, torch.Tensor]], warmup: int) -> list[float]:
    times = []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        fn(batch)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def _cached_features(target: Target, objective: Any, batch: dict[str, torch.Tensor]) -> Any:
    """What a feature cache stores for ``batch``: the objective's taps without logits or top-k (rebuilt per step),
    plus the target's greedy ids for an objective that reads its logits lazily."""
    from dataclasses import replace

    lazy = bool(objective.taps.logits and objective.taps.lazy_logits)
    taps = replace(objective.taps, logits=lazy, topk=0, final_hidden=True)
    feats = target.features(batch["input_ids"], batch["attention_mask"], taps)
    if lazy:
        feats.greedy_ids, feats.logits = feats.greedy(), None  # [B, T], as the cache stores them
    return feats


def _with_teacher(target: Target, objective: Any, feats: Any) -> Any:
    """The cached features plus the logits / top-k the objective asks for, rebuilt with the LM head (timed: training
    from a cache pays it every step)."""
    from dataclasses import replace

    taps = objective.taps
    if not (taps.logits or taps.topk):
        return feats
    if feats.greedy_ids is not None and not taps.topk:  # lazy: the objective rebuilds only the rows it scores
        return replace(feats, head_weight=target.lm_head_weight)
    logits = torch.nn.functional.linear(feats.final_hidden, target.lm_head_weight)  # [B, T, V]
    out = replace(feats, logits=logits if taps.logits else None)
    if taps.topk:
        out.topk_values, out.topk_indices = logits.topk(taps.topk, dim=-1)
    return out


def bench_train(cfg: Any, recipe: Any, steps: int = 6, warmup: int = 2) -> dict[str, Any]:
    """Measure target-forward and full training-step throughput for ``recipe`` under ``cfg``."""
    torch.manual_seed(int(cfg.run.seed))
    target = Target.load(cfg.target.name_or_path, cfg.target.dtype,
                         trust_remote_code=bool(cfg.target.trust_remote_code))
    objective = recipe.build(cfg, target)
    module = DistillModule(objective, target, dict(cfg.optim), total_steps=steps + warmup)
    optimizer = module.configure_optimizers()["optimizer"]
    batches = sample_batches(target, cfg, steps + warmup)
    tokens = int(batches[0]["attention_mask"].sum())
    precision = str(cfg.trainer.precision)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision.startswith("bf16")
                else contextlib.nullcontext())

    def forward_only(batch: dict[str, torch.Tensor]) -> None:
        target.features(batch["input_ids"], batch["attention_mask"], objective.taps)

    def train_step(batch: dict[str, torch.Tensor]) -> None:
        with autocast:
            loss, _ = module._step(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    cached = [_cached_features(target, objective, batch) for batch in batches]

    def cached_step(item: tuple[dict[str, torch.Tensor], Any]) -> None:
        batch, feats = item
        with autocast:
            loss, _ = objective.loss(batch, _with_teacher(target, objective, feats))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    fwd = statistics.median(_timed(forward_only, batches, warmup))
    step = statistics.median(_timed(train_step, batches, warmup))
    drafter_only = statistics.median(_timed(cached_step, list(zip(batches, cached)), warmup))
    trainable = sum(p.numel() for p in objective.module.parameters() if p.requires_grad)
    return {
        "recipe": recipe.name, "target_dtype": _DTYPE_NAMES.get(target.lm_head_weight.dtype, "other"),
        "target_dtype_config": str(cfg.target.dtype), "precision": precision,  # the resolved dtype, then as asked
        "batch": list(batches[0]["input_ids"].shape), "tokens_per_batch": tokens,
        "target_forward_tokens_per_s": round(tokens / fwd, 1), "train_tokens_per_s": round(tokens / step, 1),
        "ratio": round(fwd / step, 3), "drafter_only_tokens_per_s": round(tokens / drafter_only, 1),
        "cache_speedup": round(step / drafter_only, 2), "trainable_params_m": round(trainable / 1e6, 2),
        "peak_rss_mib": round(peak_rss_mib(), 1), "threads": torch.get_num_threads(),
        "timed_steps": steps, "warmup_steps": warmup,
    }
