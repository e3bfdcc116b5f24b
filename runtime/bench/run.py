"""``draftsmith bench``: prove an export in the runtime: tau, acceptance curve, tokens/s, speedups, lossless."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith import assets
from draftsmith.common.chat import encode_chat
from draftsmith.export.format import read_config
from draftsmith.export.identity import target_identity
from draftsmith.kernels import cpu_caps
from draftsmith.runtime.acceptance.choice import choose_stop_policy, choose_verifier, option_sources
from draftsmith.runtime.bench import quality, tuning
from draftsmith.runtime.bench.timing import (
    compare_outputs,
    eos_ids_from_folder,
    read_bandwidth_gbs,
    speedup_ci,
    step_weight_bytes,
    time_hf_generate,
    time_interleaved,
    time_runtime_ar,
)
from draftsmith.runtime.decoding import metrics
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.prompt_limits import check_prompt_fits
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.base import LookaheadHeads, NullProposer, WrapsTarget, build_proposer
from draftsmith.runtime.target.adapters import target_adapter
from draftsmith.runtime.target.loading import load_decoder


@dataclass
class Runtime:
    """A loaded target (runtime decoder + tokenizer) and, optionally, a speculative decoder for an export."""

    folder: str
    model: Any
    tokenizer: Any
    eos_ids: tuple[int, ...]
    export_config: dict | None = None
    speculative: SpeculativeDecoder | None = None
    dtype_reason: str = ""
    inference: dict[str, Any] | None = None  # verifier / stop policy / proposer options that run, and their sources

    def backend_report(self) -> dict[str, Any]:
        """What runs and why: CPU, dtype, linear backend (for bench.json, the bench table and generate --verbose)."""
        plan = getattr(self.model, "linear_plan", None)
        return {"cpu": cpu_caps.probe().describe(), "dtype": str(self.model.dtype).replace("torch.", ""),
                "dtype_reason": self.dtype_reason,
                "linear_backend": plan.label if plan else "hf (transformers fallback)",
                "linear_reason": plan.reason if plan else "architecture not supported by the lean decoder",
                "kernels": getattr(self.model, "kernel_backend", "n/a"), "device": str(self.model.device)}


def parse_options(pairs: list[str] | None) -> dict[str, Any]:
    """``["depth=2", "policy=chain"]`` -> ``{"depth": 2, "policy": "chain"}`` (JSON values where they parse)."""
    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"proposer option {pair!r} must look like key=value (e.g. depth=2)")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """``auto`` / ``fp32`` / ``bf16`` -> torch dtype for the runtime (see :func:`resolve_runtime_dtype`)."""
    return resolve_runtime_dtype(name, device)[0]


def resolve_runtime_dtype(name: str, device: str = "cpu") -> tuple[torch.dtype, str]:
    """The runtime's dtype and why. ``auto``: bf16 where the device computes it natively or the fused C++ layer runs
    (its AVX2 variant streams bf16 weights with fp32 math, so bf16 halves the bytes a step reads), else fp32."""
    if name != "auto" or torch.device(device).type != "cpu":
        return cpu_caps.resolve_dtype(name, device)
    from draftsmith.kernels import cpu_layer

    caps = cpu_caps.probe()
    if caps.native_bf16:
        return torch.bfloat16, f"auto -> bf16 (CPU has {caps.best_isa()})"
    reason = cpu_layer.why_unavailable()
    if reason is None:
        return torch.bfloat16, f"auto -> bf16 (no bf16 arithmetic, but the fused layer's {caps.cpu_layer_isa()} " \
                               "variant reads bf16 weights and computes in fp32)"
    return torch.float32, f"auto -> fp32 (no bf16 instructions and no fused layer: {reason})"


def hf_fastest_dtype(device: str = "cpu") -> tuple[torch.dtype, str]:
    """The dtype HF ``generate`` runs fastest in on this device: bf16 where it is native, else fp32 (HF's bf16 on a
    CPU without bf16 instructions is emulated and several times slower, so comparing against it is unfair)."""
    return cpu_caps.resolve_dtype("auto", device)


def load_runtime(drafter: str | None, target: str | None, dtype: str = "fp32", kernels: str = "auto",
                 verifier: str = "auto", temperature: float = 0.0, max_cache_len: int = 4096,
                 proposer_options: dict[str, Any] | None = None, linear_backend: str = "auto",
                 stop_policy: str | None = None, controller: str | None = None) -> Runtime:
    """Load the target (from ``target`` or the export's record) and the export's proposer, checking identity.
    ``linear_backend`` picks how the lean decoder runs its linears (see ``draftsmith.runtime.target.linear_ops``).
    Verifier, stop policy and proposer options: the flags where given, else the export's ``inference`` block
    (``runtime.inference`` records each choice and its source; see ``draftsmith.runtime.acceptance.choice``)."""
    from transformers import AutoConfig, AutoTokenizer

    stop_policy = None if stop_policy in ("auto", "export") else stop_policy  # the export's; bench may tune it
    export_config = read_config(drafter) if drafter else None
    if controller and not target and export_config is None:
        target = read_config(controller)["target"]["name_or_path"]
    name = target or (export_config["target"]["name_or_path"] if export_config else "smollm2-135m")
    folder = assets.resolve_target(name)
    if not Path(folder).is_dir():
        raise FileNotFoundError(f"target folder {folder} not found; pass --target PATH to the target the drafter "
                                "was trained for")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    torch_dtype, dtype_reason = resolve_runtime_dtype(dtype)
    adapter = target_adapter(drafter, export_config) if drafter else None  # Medusa-2: the target it trained
    model = load_decoder(folder, dtype=torch_dtype, kernel_backend=kernels, linear_backend=linear_backend,
                         transform_weights=adapter[0] if adapter else None)
    runtime = Runtime(str(folder), model, tokenizer, eos_ids_from_folder(folder), export_config,
                      dtype_reason=dtype_reason)
    if drafter:
        identity = target_identity(export_config["target"]["name_or_path"], AutoConfig.from_pretrained(folder),
                                   tokenizer, model.lm_head_weight)
        if adapter:
            identity = {**identity, "adapter": adapter[1]}
        proposer = build_proposer(drafter, model, identity=identity, given=target or str(folder),
                                  **(proposer_options or {}))
        chosen_verifier, verifier_info = choose_verifier(verifier, temperature, kernels, export_config)
        policy, policy_info = choose_stop_policy(stop_policy, export_config, export_dir=drafter)
        runtime.inference = {"verifier": verifier_info, "stop_policy": policy_info,
                             "proposer_options": option_sources(export_config, proposer_options)}
        verify_model = proposer.wrap_target(model) if isinstance(proposer, WrapsTarget) else model  # Kangaroo
        runtime.speculative = SpeculativeDecoder(verify_model, proposer, chosen_verifier, stop_policy=policy,
                                                 kernels_backend=kernels, max_cache_len=max_cache_len)
    if controller:
        identity = target_identity(read_config(controller)["target"]["name_or_path"], AutoConfig.from_pretrained(folder),
                                   tokenizer, model.lm_head_weight)
        attach_controller(runtime, controller, identity, target or str(folder), kernels, max_cache_len)
    return runtime


def attach_controller(runtime: Runtime, controller: str, identity: dict, given: str, kernels: str = "auto",
                      max_cache_len: int = 4096) -> None:
    """Sample with an adaptive-temperature export's per-position temperatures: with a drafter, its speculative loop
    verifies by rejection sampling at each node's temperature (the adaptive decoder's law exactly); without one, the
    same loop with the null proposer is the adaptive decoder alone. The controller must be for this target."""
    from draftsmith.controllers.adaptive_temperature import AdaptiveTemperatureHead, TemperaturePolicy
    from draftsmith.export.format import check_target
    from draftsmith.runtime.acceptance.verifiers import RejectionSamplingVerifier

    head, config = AdaptiveTemperatureHead.from_export(controller)
    check_target(config, identity, given)  # a controller trained on another target's hidden states is refused
    head = head.to(device=runtime.model.device)
    policy = TemperaturePolicy(head, mode=(config.get("inference") or {}).get("choice", "greedy"))
    spec = runtime.speculative
    proposer = spec.proposer if spec is not None else NullProposer()
    runtime.speculative = SpeculativeDecoder(spec.model if spec is not None else runtime.model, proposer,
                                             RejectionSamplingVerifier(1.0), spec.stop_policy if spec else None,
                                             kernels_backend=kernels, max_cache_len=max_cache_len,
                                             temperature_policy=policy)  # the policy itself: the loop calls its reset
    runtime.inference = {**(runtime.inference or {}), "controller": {"export": str(controller),
                                                                      "grid": list(head.config.grid),
                                                                      "granularity": policy.granularity}}


def load_prompts(spec: str, tokenizer: Any, limit: int | None, max_len: int | None = None) -> list[list[int]]:
    """``mtbench`` (first turns of the 80 questions), ``humaneval`` (the 164 problems as chat prompts) or a jsonl
    with ``prompt`` or MT-Bench ``turns``. With
    ``max_len`` (the target's context), a prompt that cannot fit fails at once, named, before any model work."""
    if spec == "mtbench":
        texts = [q["turns"][0] for q in assets.mtbench_questions()]
    elif spec == "humaneval":
        texts = assets.humaneval_prompts()
    else:
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"prompts file {path} not found (use 'mtbench' or a .jsonl with a 'prompt' field)")
        texts = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not valid JSON ({err})") from err
            text = record.get("prompt") or (record.get("turns") or [None])[0]
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{path}:{n}: needs a non-empty 'prompt' string or a 'turns' list")
            texts.append(text)
    texts = texts[:limit] if limit else texts
    if not texts:
        raise ValueError(f"no prompts in {spec}")
    encoded = [encode_chat(tokenizer, t) for t in texts]
    for n, ids in enumerate(encoded, 1):
        if max_len is not None:
            check_prompt_fits(len(ids), max_len, f"prompt {n} of {spec} ({texts[n - 1][:40]!r}...)")
    return encoded


FORWARD_SIZES = (1, 2, 4, 8, 16)  # new tokens per forward: how verify cost grows with tree size on this machine


def _step_costs(runtime: Runtime, prompt: list[int], repeats: int = 5) -> dict[str, Any]:
    """Median wall time of one plain decode step, of one verify forward of the export's tree, and of forwards of
    ``FORWARD_SIZES`` new tokens (to size trees for the machine)."""
    model, spec = runtime.model, runtime.speculative
    nodes = spec.proposer.max_tree_nodes if spec else 1
    cache = model.allocate_cache(len(prompt) + max(nodes, *FORWARD_SIZES) + 1)
    with torch.inference_mode():
        model.forward(torch.tensor(prompt), cache, logits_for="last")
        cache.commit(len(prompt))

        def one(tokens: int) -> float:
            ids = torch.full((tokens,), int(prompt[-1]))
            mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()
            start = time.perf_counter()
            model.forward(ids, cache, tree_mask=mask if tokens > 1 else None, logits_for="all")
            return time.perf_counter() - start

        one(1)
        ms = {t: 1e3 * statistics.median(one(t) for _ in range(repeats)) for t in sorted({1, nodes, *FORWARD_SIZES})}
    weights = step_weight_bytes(model)
    bandwidth = read_bandwidth_gbs()
    floor_ms = weights / (bandwidth * 1e9) * 1e3
    return {"tree_nodes": nodes, "ar_step_ms": ms[1], "verify_forward_ms": ms[nodes],
            "forward_ms_by_new_tokens": {t: ms[t] for t in FORWARD_SIZES},
            "weight_bytes_per_step": weights, "read_bandwidth_gbs": bandwidth, "bandwidth_floor_ms": floor_ms,
            "ar_step_over_floor": ms[1] / floor_ms}


def head_agreement(runtime: Runtime, prompts: list[list[int]], continuations: list[list[int]]) -> list[float] | None:
    """Per-head top-1 agreement with the target's own greedy tokens on held-out prompts (Medusa-style heads).

    For each prompt, the target's greedy continuation is scored in one forward; head k at position t is right
    when its top-1 equals the continuation token at t+k+2. Only positions whose label lies in the continuation
    count. Returns one fraction per head, or None for proposers without heads.
    """
    proposer = runtime.speculative.proposer if runtime.speculative else None
    if not isinstance(proposer, LookaheadHeads):
        return None
    hits: list[int] = []
    total: list[int] = []
    with torch.inference_mode():
        for prompt, cont in zip(prompts, continuations):
            seq = list(prompt) + list(cont)
            if len(cont) < 3:
                continue
            cache = runtime.model.allocate_cache(len(seq))
            hidden = runtime.model.forward(torch.tensor(seq), cache, logits_for="last").hidden  # [T, H]
            top1 = proposer.lookahead_top1(hidden)  # [K, T] target ids
            labels = torch.tensor(seq)
            if not hits:
                hits, total = [0] * top1.shape[0], [0] * top1.shape[0]
            for k in range(top1.shape[0]):
                first = max(len(prompt) - k - 2, 0)  # label t+k+2 must be a generated token
                pred = top1[k, first:len(seq) - k - 2]
                hits[k] += int((pred == labels[first + k + 2:]).sum())
                total[k] += pred.numel()
    return [h / t if t else 0.0 for h, t in zip(hits, total)]


def lossless_check(drafter: str, target: str | None, prompts: list[list[int]], max_new_tokens: int,
                   dtype: str = "fp32", kernels: str = "auto",
                   proposer_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Greedy speculative output vs greedy HF ``generate`` of the target, token for token, in ``dtype``.

    Exactness is checked in fp32: in bf16, verifying a block is not bit-identical to decoding token by token
    (different reduction orders), so near-ties can legitimately flip.
    """
    runtime = load_runtime(drafter, target, dtype, kernels, "greedy", 0.0, proposer_options=proposer_options)
    hf = time_hf_generate(runtime.folder, prompts, max_new_tokens, dtype=runtime.model.dtype)
    spec = [runtime.speculative.generate(p, max_new_tokens, eos_ids=runtime.eos_ids).tokens for p in prompts]
    # "hf" lets run_bench reuse this timed HF run when HF's fastest dtype is the check's dtype (fp32 CPUs).
    return {"dtype": dtype, **compare_outputs(hf["outputs"], spec), "hf": hf}


def run_bench(runtime: Runtime, prompts: list[list[int]], max_new_tokens: int, skip_hf: bool = False,
              temperature: float = 0.0, lossless: dict[str, Any] | None = None,
              hf_dtype: str = "same", hf_result: dict[str, Any] | None = None, cost_aware: bool = False,
              profile: bool = False, sweep_k: list[int] | None = None) -> dict[str, Any]:
    """Time HF generate, runtime AR and speculative decoding on the same prompts.

    The runtime runs in its own dtype; HF ``generate`` in ``hf_dtype`` ("same": the runtime's; "auto": HF's fastest
    on this device, see :func:`hf_fastest_dtype`, which is what ``draftsmith bench`` uses so that "runtime AR vs HF"
    compares against a fair peer; or a dtype name).

    ``lossless``: the result of :func:`lossless_check` when it was run separately (e.g. fp32 while timing bf16);
    otherwise greedy outputs are compared here, in the timing dtype. Its timed HF run is reused when it ran in the
    dtype HF is to be timed in (or pass ``hf_result`` from :func:`time_hf_generate` directly).

    ``cost_aware``: before timing, calibrate and apply the fastest draft depth for this machine (plain decoding
    when speculation is predicted to lose; see :mod:`draftsmith.runtime.bench.tuning`). ``profile``: time each part
    of the speculative step in an extra pass. ``sweep_k``: also time every fixed depth K on the same prompts.
    """
    spec = runtime.speculative
    if hf_dtype == "same":
        hf_torch_dtype, hf_reason = runtime.model.dtype, "same as the runtime"
    elif hf_dtype == "auto":
        hf_torch_dtype, hf_reason = hf_fastest_dtype(str(runtime.model.device))
    else:
        hf_torch_dtype, hf_reason = cpu_caps.resolve_dtype(hf_dtype, runtime.model.device)
    lossless = dict(lossless) if lossless is not None else None
    hf_result = hf_result or (lossless or {}).pop("hf", None)
    if skip_hf:
        hf = None
    elif hf_result is not None and hf_result.get("dtype") == hf_torch_dtype and len(hf_result["outputs"]) == len(prompts):
        hf = hf_result
    else:
        hf = time_hf_generate(runtime.folder, prompts, max_new_tokens, dtype=hf_torch_dtype)
    hf_same_dtype = hf is not None and hf_torch_dtype == runtime.model.dtype
    costs = _step_costs(runtime, prompts[0])
    cost_model, export_proposer = None, spec.proposer
    if cost_aware:  # the cost model's plain step: a short AR run on the calibration prompts
        probe = time_runtime_ar(runtime.model, prompts[:tuning.CALIBRATION_PROMPTS], tuning.CALIBRATION_TOKENS,
                                eos_ids=runtime.eos_ids)
        verify_ms = {**costs["forward_ms_by_new_tokens"], costs["tree_nodes"]: costs["verify_forward_ms"]}
        _, cost_model = tuning.choose_cost_aware_depth(runtime, prompts, 1e3 * probe["seconds"] / max(1, probe["tokens"]),
                                                       verify_ms)
    results: list[Any] = []

    def decode(prompt: list[int]) -> list[int]:
        gen = torch.Generator().manual_seed(len(results))
        result = spec.generate(prompt, max_new_tokens, eos_ids=runtime.eos_ids, generator=gen)
        results.append(result)
        return result.tokens

    # AR and speculative decoding alternate prompt by prompt, so the speedup is not the machine's drift.
    timed = time_interleaved(
        {"runtime_ar": lambda p: generate_ar(runtime.model, p, max_new_tokens, eos_ids=runtime.eos_ids),
         "speculative": decode},
        prompts, {"runtime_ar": lambda: generate_ar(runtime.model, prompts[0], 4, eos_ids=runtime.eos_ids),
                  "speculative": lambda: spec.generate(prompts[0], 4, eos_ids=runtime.eos_ids)})
    ar, sp = timed["runtime_ar"], timed["speculative"]
    ar_step = ar["seconds"] / max(1, ar["tokens"])
    results = results[-len(prompts):]
    steps = sum(r.steps for r in results)
    pooled_accepted = [a for r in results for a in r.accepted_per_step]
    tau = metrics.tau(pooled_accepted)
    by_position = metrics.acceptance_by_position(pooled_accepted, [d for r in results for d in r.depths])
    # Same-dtype reference: HF when it ran in the runtime's dtype, else the runtime's own AR (itself checked vs HF).
    reference = hf["outputs"] if hf_same_dtype else ar["outputs"]
    same_dtype = None
    if temperature == 0 and getattr(spec.verifier, "lossless", True):
        same_dtype = {"dtype": str(runtime.model.dtype).replace("torch.", ""),
                      "reference": "hf_generate" if hf_same_dtype else "runtime_ar",
                      **compare_outputs(reference, sp["outputs"])}
    lossless = lossless if lossless is not None else same_dtype
    agreement = head_agreement(runtime, prompts, ar["outputs"])
    target_change = None
    if ((runtime.export_config or {}).get("target") or {}).get("adapter"):  # Medusa-2: served on the adapted target
        original = load_decoder(runtime.folder, dtype=runtime.model.dtype)
        original_outputs = time_runtime_ar(original, prompts, max_new_tokens, eos_ids=runtime.eos_ids)["outputs"]
        target_change = quality.lossy_target_report(runtime, original, sp["outputs"],
                                                    original_outputs if temperature == 0 else None)
        del original
    spec_step = sp["seconds"] / max(1, steps)
    step_profile = tuning.profiled_run(spec, prompts, max_new_tokens, runtime.eos_ids)[0] if profile else None
    sweep = None
    if sweep_k:  # its own interleaved pass: plain AR, each fixed K and the policy in force, comparable row to row
        sweep = tuning.sweep_fixed_depths(runtime, prompts, max_new_tokens, sweep_k, export_proposer)
        for row in sweep:
            row["speedup_vs_runtime_ar"] = row["tokens_per_s"] / sweep[0]["tokens_per_s"]
    verify_reuse = None
    if callable(getattr(spec.model, "saved_share", None)):  # Kangaroo: verify forwards that skipped the shallow layers
        verify_reuse = {"reused_tokens": spec.model.reused_tokens, "verified_tokens": spec.model.verified_tokens,
                        "verify_compute_saved": spec.model.saved_share()}
    tps = {"hf_generate": hf["tokens_per_s"] if hf else None, "runtime_ar": ar["tokens_per_s"],
           "speculative": sp["tokens_per_s"]}
    return {
        "method": runtime.export_config["method"], "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "dtype": str(runtime.model.dtype).replace("torch.", ""), "temperature": temperature,
        "linear_backend": getattr(runtime.model, "linear_ops", "hf"), "backend": runtime.backend_report(),
        "hf_dtype": None if hf is None else str(hf_torch_dtype).replace("torch.", ""), "hf_dtype_reason": hf_reason,
        "verifier": type(spec.verifier).__name__, "inference": runtime.inference, "tau": tau, "acceptance_by_position": by_position,
        "head_agreement_top1": agreement,
        "tokens_per_s": tps,
        "speedup": {"vs_hf_generate": (tps["speculative"] / tps["hf_generate"]) if hf else None,
                    "vs_runtime_ar": tps["speculative"] / tps["runtime_ar"],
                    "vs_runtime_ar_ci95": list(speedup_ci(ar, sp)),
                    "runtime_ar_vs_hf_generate": (tps["runtime_ar"] / tps["hf_generate"]) if hf else None},
        "lossless": None if lossless is None else lossless["all_identical"], "lossless_detail": lossless,
        "same_dtype_match": same_dtype,
        "runtime_ar_matches_hf": compare_outputs(hf["outputs"], ar["outputs"])["all_identical"] if hf_same_dtype
        else None,
        "step_costs": {**costs, "ar_step_ms_in_decode": 1e3 * ar_step, "spec_step_ms_in_decode": 1e3 * spec_step,
                       "predicted_speedup_tau_x_step_over_verify": tau * costs["ar_step_ms"] / costs["verify_forward_ms"]},
        "tokens": {"hf_generate": hf["tokens"] if hf else None, "runtime_ar": ar["tokens"], "speculative": sp["tokens"]},
        "threads": torch.get_num_threads(),
        "cost_model": cost_model, "profile": step_profile, "sweep": sweep, "target_change": target_change,
        "verify_reuse": verify_reuse, "served_plain": spec.serves_plain_ar(),
    }
