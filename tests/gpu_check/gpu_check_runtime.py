"""``tests/gpu_check/gpu_check.py``'s runtime stages: the lean decoder's torch vs Triton kernels
(``runtime-kernels``: fp32 parity, serving-dtype speed) and HF ``generate`` vs runtime AR vs
speculative decoding with each export (``bench:<recipe>``, plus the fp32 lossless check).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from gpu_check_core import Context

# ------------------------------------------------------------------------------------------ runtime


def torch_dtype(name: str) -> Any:
    """``fp32`` / ``bf16`` -> torch dtype."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def sync(device: str) -> None:
    """Wait for queued GPU work so wall-clock timings are real."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def export_adapter(ctx: Context, recipe: str | None) -> tuple[Any, dict] | None:
    """The target adapter an export ships (Medusa-2's LoRA): (weight transform, identity block), or
    None."""
    if recipe is None:
        return None
    from draftsmith.export.format import read_config
    from draftsmith.runtime.target.adapters import target_adapter

    key = (  # read (and fingerprinted) once per export, not per decoder / AR lookup
        f"adapter/{recipe}"
    )
    if key not in ctx.cache:
        ctx.cache[key] = target_adapter(ctx.exports[recipe], read_config(ctx.exports[recipe]))
    return ctx.cache[key]


def decoder(ctx: Context, dtype: str, kernels: str, recipe: str | None = None) -> Any:
    """The lean decoder of the target on the check's device (cached per dtype and kernel backend);
    with ``recipe``, the target that recipe's export serves (its adapter merged, if it ships
    one)."""
    from draftsmith.runtime.target.loading import load_decoder

    adapter = export_adapter(ctx, recipe)
    key = f"decoder/{dtype}/{kernels}" + (f"/{recipe}" if adapter else "")
    if key not in ctx.cache:
        ctx.cache[key] = load_decoder(
            ctx.target,
            dtype=torch_dtype(dtype),
            device=ctx.plan.device,
            backend="lean",
            kernel_backend=kernels,
            transform_weights=adapter[0] if adapter else None,
        )
    return ctx.cache[key]


def random_tree_mask(nodes: int, seed: int = 0) -> Any:
    """A valid draft-tree mask [nodes, nodes]: random parents, each node sees itself and its
    ancestors."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    mask = torch.eye(nodes, dtype=torch.bool)
    for i in range(1, nodes):
        mask[i] |= mask[int(torch.randint(0, i, (1,), generator=gen))]
    return mask


def prefill_and_tree_logits(model: Any, prompt: list[int], nodes: int = 12) -> tuple[Any, Any]:
    """Logits of a prefill and of one tree-verify forward after it (what a speculative step
    runs)."""
    import torch

    dev = model.device
    cache = model.allocate_cache(len(prompt) + nodes)
    ids = torch.tensor(prompt, device=dev)
    with torch.inference_mode():
        pre = model.forward(ids, cache, logits_for="all").logits
        cache.commit(len(prompt))
        tree = torch.tensor(
            [(prompt[i % len(prompt)] * 7 + i) % model.config.vocab_size for i in range(nodes)],
            device=dev,
        )
        mask = random_tree_mask(nodes).to(dev)
        depth = (mask.sum(-1) - 1).to(dev)
        out = model.forward(
            tree, cache, tree_mask=mask, positions=len(prompt) + depth, logits_for="all"
        ).logits
    return pre.float(), out.float()


def forward_ms(model: Any, prompt: list[int], tokens: int, device: str, repeats: int) -> float:
    """Median ms of one forward of ``tokens`` new tokens (causal) after ``prompt``."""
    import torch

    cache = model.allocate_cache(len(prompt) + tokens)
    ids = torch.tensor(prompt, device=model.device)
    new = torch.full((tokens,), int(prompt[-1]), device=model.device)
    times = []
    with torch.inference_mode():
        model.forward(ids, cache, logits_for="last")
        cache.commit(len(prompt))
        for _ in range(repeats + 1):
            sync(device)
            start = time.perf_counter()
            model.forward(new, cache, logits_for="all")
            sync(device)
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def kernel_parity(ctx: Context) -> dict:
    """fp32: max |logit diff| torch vs triton (prefill, tree forward) and greedy tokens equal on
    every prompt."""
    from draftsmith.runtime.decoding.autoregressive import generate_ar

    ref, tri = decoder(ctx, "fp32", "torch"), decoder(ctx, "fp32", "triton")
    diff, same = 0.0, 0
    for prompt in ctx.prompts:
        for a, b in zip(
            prefill_and_tree_logits(ref, prompt), prefill_and_tree_logits(tri, prompt), strict=True
        ):
            diff = max(diff, float((a - b).abs().max()))
        n = ctx.plan.kernel_tokens
        same += generate_ar(ref, prompt, n) == generate_ar(tri, prompt, n)
    # free the fp32 pair; the timings below load the serving dtype
    if ctx.plan.speed_dtype != "fp32":
        for key in [k for k in ctx.cache if k.startswith("decoder/fp32/")]:
            del ctx.cache[key]
    return {
        "fp32_max_logit_diff": diff,
        "fp32_greedy_equal": f"{same}/{len(ctx.prompts)}",
        "ok": same == len(ctx.prompts) and diff < 1e-3,
    }


def kernel_speed(ctx: Context) -> dict:
    """Serving dtype: AR tokens/s and one 16-token forward (a verify-sized step) with each kernel
    backend."""
    from draftsmith.bench.timing import compare_outputs, time_runtime_ar

    plan = ctx.plan
    dtype, numbers, outputs, prompts = plan.speed_dtype, {}, {}, ctx.prompts[: plan.speed_prompts]
    for kernels in ("torch", "triton"):
        model = decoder(ctx, dtype, kernels)
        ar = time_runtime_ar(model, prompts, plan.kernel_tokens)
        outputs[kernels] = ar["outputs"]
        numbers[f"{kernels}_ar_tok_per_s"] = round(ar["tokens_per_s"], 1)
        numbers[f"{kernels}_fwd16_ms"] = round(
            forward_ms(model, prompts[0], 16, plan.device, plan.repeats), 3
        )
    if dtype != "fp32":  # fp32 agreement is the parity check itself
        agree = compare_outputs(outputs["torch"], outputs["triton"])
        numbers[f"{dtype}_greedy_equal"] = f"{agree['identical']}/{agree['total']}"
    numbers["triton_vs_torch_ar"] = numbers["triton_ar_tok_per_s"] / numbers["torch_ar_tok_per_s"]
    return numbers


def stage_kernels(ctx: Context) -> dict:
    """Lean decoder, torch vs Triton kernels: fp32 parity decides pass/fail; the serving-dtype
    numbers are timings."""
    if ctx.target is None:
        raise RuntimeError("setup failed: no target")
    parity = kernel_parity(ctx)
    ok = parity.pop("ok")
    numbers = {**parity, **kernel_speed(ctx)}
    note = (
        f"parity in fp32, timings in {ctx.plan.speed_dtype} (greedy agreement there is information"
        " only)"
    )
    if ctx.plan.device == "cpu":
        note += "; triton through TRITON_INTERPRET=1"
    return {
        "ok": ok,
        "numbers": numbers,
        "note": note,
        "error": "" if ok else "torch and triton kernels disagree (fp32)",
    }


def hf_reference(ctx: Context, dtype: str) -> dict:
    """HF ``generate`` on the device (timed once per dtype; every recipe's bench reuses it)."""
    from draftsmith.bench.timing import time_hf_generate

    key = f"hf/{dtype}"
    if key not in ctx.cache:
        ctx.cache[key] = time_hf_generate(
            ctx.target,
            ctx.prompts,
            ctx.plan.new_tokens,
            dtype=torch_dtype(dtype),
            device=ctx.plan.device,
        )
    return ctx.cache[key]


def runtime_ar(ctx: Context, dtype: str, recipe: str | None = None) -> dict:
    """Runtime AR greedy decoding (auto kernels), timed once per dtype (and per adapter-carrying
    export: its speculative output must equal AR on the target it serves, adapter merged)."""
    from draftsmith.bench.timing import eos_ids_from_folder, time_runtime_ar

    key = f"ar/{dtype}" + (f"/{recipe}" if export_adapter(ctx, recipe) else "")
    if key not in ctx.cache:
        ctx.cache[key] = time_runtime_ar(
            decoder(ctx, dtype, "auto", recipe),
            ctx.prompts,
            ctx.plan.new_tokens,
            eos_ids=eos_ids_from_folder(ctx.target),
        )
    return ctx.cache[key]


def speculative(ctx: Context, recipe: str, dtype: str) -> tuple[dict, list]:
    """Greedy speculative decoding with the recipe's export (auto kernels): timing dict and
    per-prompt results."""
    from draftsmith.bench.timing import eos_ids_from_folder, time_decode
    from draftsmith.runtime.acceptance.verifiers import GreedyVerifier
    from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
    from draftsmith.runtime.drafting.registry import build_proposer

    model, adapter = decoder(ctx, dtype, "auto", recipe), export_adapter(ctx, recipe)
    identity = {"adapter": adapter[1]} if adapter else None
    proposer = build_proposer(ctx.exports[recipe], model, identity=identity)
    spec = SpeculativeDecoder(model, proposer, GreedyVerifier("auto"), kernel_backend="auto")
    eos, n, results = eos_ids_from_folder(ctx.target), ctx.plan.new_tokens, []

    def decode(prompt: list[int]) -> list[int]:
        results.append(spec.generate(prompt, n, eos_ids=eos))
        return results[-1].tokens

    timing = time_decode(
        decode, ctx.prompts, warmup=lambda: spec.generate(ctx.prompts[0], 4, eos_ids=eos)
    )
    return timing, results


def stage_bench(ctx: Context, recipe: str) -> dict:
    """HF generate / runtime AR / speculative tokens/s and tau in the serving dtype; fp32 lossless
    check."""
    from draftsmith.bench.timing import compare_outputs

    if recipe not in ctx.exports:
        raise RuntimeError(f"no export: train:{recipe} did not produce one")
    dtype = ctx.plan.speed_dtype
    hf, ar = hf_reference(ctx, dtype), runtime_ar(ctx, dtype, recipe)
    sp, results = speculative(ctx, recipe, dtype)
    steps = sum(r.steps for r in results)
    tau = sum(sum(a + 1 for a in r.accepted_per_step) for r in results) / max(1, steps)
    spec32 = sp if dtype == "fp32" else speculative(ctx, recipe, "fp32")[0]
    lossless = compare_outputs(runtime_ar(ctx, "fp32", recipe)["outputs"], spec32["outputs"])
    # HF generate runs the bare target: an adapter-carrying export serves another model, so that row
    # is skipped.
    vs_hf = (
        None
        if export_adapter(ctx, recipe)
        else compare_outputs(hf_reference(ctx, "fp32")["outputs"], spec32["outputs"])
    )
    numbers = {
        "hf_tok_per_s": round(hf["tokens_per_s"], 1),
        "ar_tok_per_s": round(ar["tokens_per_s"], 1),
        "spec_tok_per_s": round(sp["tokens_per_s"], 1),
        "tau": round(tau, 3),
        "spec_vs_ar": round(sp["tokens_per_s"] / ar["tokens_per_s"], 2),
        "ar_vs_hf": round(ar["tokens_per_s"] / hf["tokens_per_s"], 2),
        "lossless_fp32_vs_ar": f"{lossless['identical']}/{lossless['total']}",
        "fp32_vs_hf_generate": (
            f"{vs_hf['identical']}/{vs_hf['total']}" if vs_hf else "n/a (adapter)"
        ),
    }
    for key in [k for k in ctx.cache if "/fp32" in k and k.startswith("decoder/")]:
        del ctx.cache[key]
    ok = lossless["all_identical"]
    return {
        "ok": ok,
        "numbers": numbers,
        "note": f"{dtype}, {len(ctx.prompts)} prompts x {ctx.plan.new_tokens} tokens",
        "error": (
            "" if ok else f"greedy speculative != greedy AR in fp32: {lossless['first_mismatch']}"
        ),
    }
