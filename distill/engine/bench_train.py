"""Training-throughput benchmark: a recipe's training step, its two parts, each against the
machine's own limits.

Three timed parts on the same batches (fixed packed rows, the layout ``data.tokens_per_step`` trains
on), after warm-up steps:

* ``target_forward``: the frozen target's forward with the objective's taps;
* ``drafter_only``: the step as training from a feature cache runs it (``data.features=DIR``): the
  target's features computed beforehand (outside the timer), the teacher rebuilt from the cached
  final hidden state with the LM head as
  :class:`~draftsmith.distill.feature_cache.cached_target.CachedTarget` does, then the drafter's
  forward, backward and optimizer step;
* ``train``: the online step (target forward + drafter step), as ``train.py`` runs it
  (``trainer.compile`` too).

Each is reported against the machine's measured matmul rate in the step's dtype (``utilization``,
from the FLOPs PyTorch counts for the part), and the online step against its parts:
``online_vs_parts = online / (1 / (1/target + 1/drafter-only))`` (1.0 = no overhead beyond the two).
``host`` times the same step structure with compute made
negligible (hidden 64, a 512-token vocabulary; 2 layers and the target's depth): the host's own cost
per step, which bounds a GPU step from below, with the aten ops it dispatches. ``cache_speedup`` =
drafter-only / online tokens/s.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
from dataclasses import replace
from typing import Any

import torch
from omegaconf import OmegaConf

from draftsmith.distill.cluster.strategies import resolve_precision
from draftsmith.distill.engine.bench_parts import (
    count_flops,
    count_ops,
    markdown_table,
    matmul_rate,
    parts_rate,
    timed,
    utilization,
)
from draftsmith.distill.engine.module import DistillModule
from draftsmith.distill.target.frozen import Target

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
HOST_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "head_dim": 16,
}  # a target whose compute is negligible, at the real step structure

__all__ = ["bench_train", "markdown_table", "sample_batches"]


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def sample_batches(target: Any, cfg: Any, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` batches of real chat data in fixed packed rows ([rows, max_length] with document
    ids)."""
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


def _cached_features(target: Target, objective: Any, batch: dict[str, torch.Tensor]) -> Any:
    """What a feature cache stores for ``batch``: the objective's taps without logits or top-k
    (rebuilt per step), plus the target's greedy ids for an objective that reads its logits
    lazily."""
    lazy = bool(objective.taps.logits and objective.taps.lazy_logits)
    taps = replace(objective.taps, logits=lazy, topk=0, final_hidden=True)
    feats = target.features(batch["input_ids"], batch["attention_mask"], taps, **_extras(batch))
    if lazy:
        feats.greedy_ids, feats.logits = feats.greedy(), None  # [B, T], as the cache stores them
    return feats


def _with_teacher(target: Target, objective: Any, feats: Any) -> Any:
    """The cached features plus the logits / top-k the objective asks for, rebuilt with the LM head
    (timed: training from a cache pays it every step)."""
    taps = objective.taps
    if not (taps.logits or taps.topk):
        return feats
    # lazy: the objective rebuilds only the rows it scores
    if feats.greedy_ids is not None and not taps.topk:
        return replace(feats, head_weight=target.lm_head_weight)
    logits = torch.nn.functional.linear(feats.final_hidden, target.lm_head_weight)  # [B, T, V]
    out = replace(feats, logits=logits if taps.logits else None)
    if taps.topk:
        out.topk_values, out.topk_indices = logits.topk(taps.topk, dim=-1)
    return out


def _extras(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: batch[k] for k in ("position_ids", "document_ids") if k in batch}


def _autocast(precision: str, device: str) -> Any:
    return (
        torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
        if precision.startswith("bf16")
        else contextlib.nullcontext()
    )


def step_functions(
    module: DistillModule, target: Any, precision: str, device: str
) -> dict[str, Any]:
    """The three timed parts as functions of a batch (``drafter_only`` of a (batch, cached features)
    pair)."""
    objective = module.objective
    optimizer = module.configure_optimizers()["optimizer"]

    def forward_only(batch: dict[str, torch.Tensor]) -> None:
        features = module.compiled.parts(target, objective)[
            0
        ]  # compiled as the online step's, when it is
        with torch.no_grad(), _autocast(precision, device):
            features(batch["input_ids"], batch["attention_mask"], objective.taps, **_extras(batch))

    def backward(loss: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def train_step(batch: dict[str, torch.Tensor]) -> None:
        with _autocast(precision, device):
            loss, _ = module._step(batch, training=True)
        backward(loss)

    def drafter_only(item: tuple[dict[str, torch.Tensor], Any]) -> None:
        batch, feats = item
        loss_fn = module.compiled.parts(target, objective)[1]
        with _autocast(precision, device):
            loss, _ = loss_fn(batch, _with_teacher(target, objective, feats))
        backward(loss)

    return {"target_forward": forward_only, "train": train_step, "drafter_only": drafter_only}


def _load(cfg: Any, recipe: Any, device: str, total_steps: int) -> tuple[Target, DistillModule]:
    target = Target.load(
        cfg.target.name_or_path,
        cfg.target.dtype,
        trust_remote_code=bool(cfg.target.trust_remote_code),
        runs_on=device,
    )
    objective = recipe.build(cfg, target)
    module = DistillModule(
        objective,
        target,
        dict(cfg.optim),
        total_steps=total_steps,
        compile=bool(cfg.trainer.get("compile")),
    )
    target.to(device)
    objective.module.to(device)
    return target, module


def _to(batch: dict[str, Any], device: str) -> dict[str, Any]:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def bench_train(
    cfg: Any, recipe: Any, steps: int = 6, warmup: int = 2, device: str = "cpu", host: bool = True
) -> dict[str, Any]:
    """Measure the three parts of ``recipe``'s training step under ``cfg`` on ``device`` (module
    docstring)."""
    torch.manual_seed(int(cfg.run.seed))
    precision = resolve_precision(cfg.trainer)[0]
    target, module = _load(cfg, recipe, device, steps + warmup)
    batches = [_to(b, device) for b in sample_batches(target, cfg, steps + warmup)]
    tokens = int(batches[0]["attention_mask"].sum())
    parts = step_functions(module, target, precision, device)
    cached = [(b, _cached_features(target, module.objective, b)) for b in batches]
    seconds = {
        "target_forward": statistics.median(
            timed(parts["target_forward"], batches, warmup, device)
        ),
        "train": statistics.median(timed(parts["train"], batches, warmup, device)),
        "drafter_only": statistics.median(timed(parts["drafter_only"], cached, warmup, device)),
    }
    flops = {
        "target_forward": count_flops(lambda: parts["target_forward"](batches[0])),
        "drafter_only": count_flops(lambda: parts["drafter_only"](cached[0])),
    }
    flops["train"] = flops["target_forward"] + flops["drafter_only"]
    compute = torch.bfloat16 if precision.startswith("bf16") else target.lm_head_weight.dtype
    shape = (
        tokens,
        target.hidden_size,
        int(getattr(target.config, "intermediate_size", 4 * target.hidden_size)),
    )
    rate = matmul_rate(compute, device, *shape)
    result: dict[str, Any] = {
        "recipe": recipe.name,
        "device": str(device),
        "precision": precision,
        "target_dtype": _DTYPE_NAMES.get(target.lm_head_weight.dtype, "other"),
        "target_dtype_config": str(cfg.target.dtype),
        "compile": bool(cfg.trainer.get("compile")),
        "batch": list(batches[0]["input_ids"].shape),
        "tokens_per_batch": tokens,
        "matmul_dtype": _DTYPE_NAMES.get(compute, "other"),
        "matmul_shape": "x".join(map(str, shape)),
        "matmul_gflops": round(rate / 1e9, 2),
    }
    result.update(_part_rates(seconds, flops, tokens, rate))
    result.update(_step_summary(result, seconds, module, steps, warmup))
    if torch.device(device).type == "cuda":
        result["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    if host:
        result["host"] = host_costs(cfg, recipe, target, batches, precision, device, warmup)
    return result


def _part_rates(
    seconds: dict[str, float], flops: dict[str, float], tokens: int, rate: float
) -> dict[str, Any]:
    """Tokens/s, ms, GFLOP per token and utilization of the matmul ``rate`` of each timed part."""
    out: dict[str, Any] = {}
    for key, secs in seconds.items():
        per_s = tokens / secs
        out.update(
            {
                f"{key}_tokens_per_s": round(per_s, 1),
                f"{key}_ms": round(secs * 1e3, 2),
                f"{key}_gflop_per_token": round(flops[key] / tokens / 1e9, 4),
                f"{key}_utilization": utilization(per_s, flops[key] / tokens, rate),
            }
        )
    return out


def _step_summary(
    result: dict[str, Any],
    seconds: dict[str, float],
    module: DistillModule,
    steps: int,
    warmup: int,
) -> dict[str, Any]:
    """How the online step compares with its parts (the rate they predict, the target's share, what
    a feature cache would gain), the drafter's size, the memory peak and the run's settings."""
    expected = parts_rate(
        result["target_forward_tokens_per_s"], result["drafter_only_tokens_per_s"]
    )
    trainable = sum(p.numel() for p in module.objective.module.parameters() if p.requires_grad)
    return {
        "parts_tokens_per_s": round(expected, 1),
        "online_vs_parts": round(result["train_tokens_per_s"] / expected, 4),
        "train_tokens_per_s": result["train_tokens_per_s"],
        "ratio": round(seconds["target_forward"] / seconds["train"], 3),
        "cache_speedup": round(seconds["train"] / seconds["drafter_only"], 2),
        "trainable_params_m": round(trainable / 1e6, 2),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "threads": torch.get_num_threads(),
        "timed_steps": steps,
        "warmup_steps": warmup,
    }


def host_costs(
    cfg: Any,
    recipe: Any,
    target: Target,
    batches: list[dict[str, torch.Tensor]],
    precision: str,
    device: str,
    warmup: int,
) -> list[dict[str, Any]]:
    """ms per online step and aten ops per step of ``recipe`` on a target of negligible compute
    (:data:`HOST_SHAPE`) at 2 layers and at the target's depth, same batch shape and document layout
    (ids folded into its vocabulary).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    rows = []
    for layers in sorted({2, target.num_layers}):
        small_cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        drafter = small_cfg.get("drafter") or {}
        if "draft_vocab_size" in drafter:
            small_cfg.drafter.draft_vocab_size = 0  # the whole 512-token vocabulary: no data scan
        if "target_layers" in drafter:
            small_cfg.drafter.target_layers = (
                [0, layers // 2, layers - 1] if layers > 2 else [0, 1, 1]
            )
        torch.manual_seed(0)
        model = LlamaForCausalLM(
            LlamaConfig(**HOST_SHAPE, num_hidden_layers=layers, tie_word_embeddings=True)
        )
        small = Target(model.to(target.lm_head_weight.dtype), target.tokenizer, f"host-{layers}")
        objective = recipe.build(small_cfg, small)
        module = DistillModule(
            objective,
            small,
            dict(small_cfg.optim),
            total_steps=len(batches),
            compile=bool(cfg.trainer.get("compile")),
        )
        small.to(device)
        objective.module.to(device)
        folded = [{**b, "input_ids": b["input_ids"] % HOST_SHAPE["vocab_size"]} for b in batches]
        train = step_functions(module, small, precision, device)["train"]
        ms = statistics.median(timed(train, folded, warmup, device)) * 1e3
        rows.append(
            {
                "what": f"{layers} layers, hidden 64, vocab 512",
                "layers": layers,
                "ms_per_step": round(ms, 2),
                **count_ops(lambda step=train, batch=folded[0]: step(batch)),
            }
        )
    return rows
