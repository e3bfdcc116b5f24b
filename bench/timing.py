"""Timing harness: tokens/s of HF ``generate``, of the runtime's autoregressive mode, and (via
:func:`time_decode`) of any other decoding function such as speculative decoding; plus the lossless
comparison of outputs.

Every timer returns the same dict: ``tokens`` (new tokens over all prompts), ``seconds`` (decode
wall time, warmup excluded), ``tokens_per_s``, ``outputs`` (one list of new token ids per prompt)
and ``per_prompt`` (tokens, seconds).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from draftsmith.bench import progress
from draftsmith.common.chat import encode_chat
from draftsmith.common.dtypes import dtype_from_name
from draftsmith.kernels import cpu_caps
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.prompt_limits import cap_new_tokens
from draftsmith.runtime.serving import Runtime, eos_ids_from_folder, hf_fastest_dtype
from draftsmith.runtime.target.hf_attention import hf_sizes
from draftsmith.runtime.target.interface import TargetDecoder

DecodeFn = Callable[[list[int]], list[int]]


def time_decode(
    decode: DecodeFn, prompts_ids: Sequence[list[int]], warmup: Callable[[], object] | None = None
) -> dict[str, Any]:
    """Time ``decode(prompt_ids) -> new token ids`` over the prompts (sequentially, batch 1).

    ``warmup`` (a short run, e.g. the same decoder with a few new tokens) is called once first and
    not timed; it pays one-off costs such as allocator growth, kernel selection and lazy imports.
    """
    if not prompts_ids:
        raise ValueError("no prompts to time: pass at least one list of prompt token ids")
    return time_interleaved(
        {"decode": decode}, prompts_ids, {"decode": warmup} if warmup else None
    )["decode"]


def time_interleaved(
    decoders: dict[str, DecodeFn],
    prompts_ids: Sequence[list[int]],
    warmups: dict[str, Callable[[], object]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Time several decoders on the same prompts, alternating per prompt: prompt i runs them in an
    order rotated by i. A machine's speed drifts during a bench (frequency, other load, allocator
    growth); timing one decoder after the other puts all the drift on whichever ran second, which
    made two identical decoders differ by 10%. Interleaved, the drift is shared. Returns one
    :func:`time_decode` dict per decoder name."""
    if not prompts_ids:
        raise ValueError("no prompts to time: pass at least one list of prompt token ids")
    for warmup in (warmups or {}).values():
        if warmup is not None:
            warmup()
    names = list(decoders)
    outputs: dict[str, list[list[int]]] = {n: [] for n in names}
    per_prompt: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for i, prompt in enumerate(prompts_ids):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            new = decoders[name](list(prompt))
            dt = time.perf_counter() - t0
            outputs[name].append(list(new))
            per_prompt[name].append({"tokens": len(new), "seconds": dt})
        progress.step()  # one more prompt for the bench phase running (if any)
    report = {}
    for name in names:
        tokens = sum(p["tokens"] for p in per_prompt[name])
        seconds = sum(p["seconds"] for p in per_prompt[name])
        report[name] = {
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
            "outputs": outputs[name],
            "per_prompt": per_prompt[name],
        }
    return report


def speedup_ci(
    base: dict[str, Any], other: dict[str, Any], draws: int = 2000, seed: int = 0
) -> tuple[float | None, float | None]:
    """95% percentile-bootstrap interval of ``other``'s tokens/s over ``base``'s, resampling prompts
    (paired: both timers' ``per_prompt`` rows come from the same prompts, as
    :func:`time_interleaved` gives them).

    One prompt's ratio swings by about 10% on a 2-core CPU even between two identical decoders, so a
    speedup from 8 prompts is only known to a few percent; the interval says how many."""
    a, b = base["per_prompt"], other["per_prompt"]
    if len(a) != len(b):
        raise ValueError(
            f"speedup_ci needs the same prompts for both timers, got {len(a)} and {len(b)} rows"
        )
    if len(a) < 2:  # one prompt: no interval (None keeps bench.json valid JSON)
        return (None, None)
    rng, n = random.Random(seed), len(a)
    ratios = []
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        rate_a = sum(a[i]["tokens"] for i in idx) / max(sum(a[i]["seconds"] for i in idx), 1e-12)
        rate_b = sum(b[i]["tokens"] for i in idx) / max(sum(b[i]["seconds"] for i in idx), 1e-12)
        if rate_a > 0 and rate_b > 0:  # a draw of prompts with no tokens has no ratio
            ratios.append(rate_b / rate_a)
    if not ratios:
        return (None, None)
    ratios.sort()
    return ratios[int(0.025 * len(ratios))], ratios[max(0, int(0.975 * len(ratios)) - 1)]


def time_hf_generate(
    folder: str | Path,
    prompts_ids: Sequence[list[int]],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    model: torch.nn.Module | None = None,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Greedy HF ``generate`` (``do_sample=False``, stops at EOS as usual) on the folder's model,
    batch 1, each generation capped at the model's context as the runtime caps its own
    (``prompt_limits.cap_new_tokens``).

    Pass ``model`` to reuse an already loaded ``AutoModelForCausalLM`` (then ``folder`` only names
    it);
    ``trust_remote_code``: the folder's own model code may run (the user opted in when loading the
    runtime).
    """
    if model is None:
        from transformers import AutoModelForCausalLM

        model = (
            AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=dtype, local_files_only=True, trust_remote_code=trust_remote_code
            )
            .to(device)
            .eval()
        )
    pad = (eos_ids_from_folder(folder) or (0,))[0]
    context = hf_sizes(model.config).context_length

    def run(prompt: list[int], n: int) -> list[int]:
        n = cap_new_tokens(len(prompt), n, context)
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=pad,
            )
        return out[0, ids.shape[1] :].tolist()

    result = time_decode(
        lambda p: run(p, max_new_tokens), prompts_ids, warmup=lambda: run(prompts_ids[0], 4)
    )
    result["method"] = "hf_generate"
    result["dtype"] = next(model.parameters()).dtype
    return result


def time_runtime_ar(
    model: TargetDecoder,
    prompts_ids: Sequence[list[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
) -> dict[str, Any]:
    """Greedy autoregressive decoding with a runtime decoder (:func:`generate_ar`); stops at
    ``eos_ids``."""

    def run(prompt: list[int], n: int) -> list[int]:
        return generate_ar(model, prompt, n, eos_ids=eos_ids)

    result = time_decode(
        lambda p: run(p, max_new_tokens), prompts_ids, warmup=lambda: run(prompts_ids[0], 4)
    )
    result["method"] = "runtime_ar"
    return result


def compare_outputs(
    reference: Sequence[list[int]], candidate: Sequence[list[int]]
) -> dict[str, Any]:
    """Lossless check: how many outputs are token-identical, and where the first differing one
    diverges."""
    if len(reference) != len(candidate):
        raise ValueError(
            f"{len(reference)} reference outputs vs {len(candidate)} candidate outputs"
        )
    same, first = 0, None
    for i, (a, b) in enumerate(zip(reference, candidate)):
        if list(a) == list(b):
            same += 1
        elif first is None:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first = {"prompt": i, "position": pos}
    return {
        "identical": same,
        "total": len(reference),
        "all_identical": same == len(reference),
        "first_mismatch": first,
    }


DEFAULT_PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a short Python function that checks whether a number is prime.",
    "Give three tips for staying focused while studying.",
)


def chat_prompts_ids(
    folder: str | Path, prompts: Sequence[str] = DEFAULT_PROMPTS
) -> list[list[int]]:
    """Token ids of ``prompts`` as single-turn chats with the folder's tokenizer and chat
    template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return [encode_chat(tok, text) for text in prompts]


def compare_ar(
    folder: str | Path, max_new_tokens: int = 64, dtypes: Sequence[str] = ("fp32", "bf16")
) -> dict:
    """HF ``generate`` vs the runtime's AR mode on the folder's model for each dtype: tokens/s,
    speedup, lossless."""
    from draftsmith.runtime.target.loading import load_decoder

    prompts = chat_prompts_ids(folder)
    eos = eos_ids_from_folder(folder)
    report: dict[str, Any] = {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "threads": torch.get_num_threads(),
    }
    for name in dtypes:
        hf = time_hf_generate(folder, prompts, max_new_tokens, dtype=dtype_from_name(name))
        ar = time_runtime_ar(
            load_decoder(folder, dtype=dtype_from_name(name)), prompts, max_new_tokens, eos_ids=eos
        )
        report[name] = {
            "hf_tokens_per_s": round(hf["tokens_per_s"], 2),
            "runtime_ar_tokens_per_s": round(ar["tokens_per_s"], 2),
            "speedup": round(ar["tokens_per_s"] / hf["tokens_per_s"], 2),
            "lossless": compare_outputs(hf["outputs"], ar["outputs"]),
        }
    return report


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        description="HF generate vs runtime AR tokens/s on a local HF model folder"
    )
    parser.add_argument("folder")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtypes", default="fp32,bf16")
    args = parser.parse_args()
    print(
        json.dumps(compare_ar(args.folder, args.max_new_tokens, args.dtypes.split(",")), indent=2)
    )


def hf_baseline(
    runtime: Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    skip_hf: bool,
    hf_dtype: str,
    lossless: dict[str, Any] | None,
    hf_result: dict[str, Any] | None,
) -> tuple[dict[str, Any] | None, torch.dtype, str, dict[str, Any] | None]:
    """HF ``generate`` timed in ``hf_dtype`` (see :func:`draftsmith.bench.run.run_bench`): ``(timing
    or None with skip_hf, the dtype, why that dtype, lossless)``. A timed HF run carried by
    ``lossless`` (taken out of a copy of it, returned) or passed as ``hf_result`` is reused when it
    ran in that dtype on as many prompts."""
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
    elif (
        hf_result is not None
        and hf_result.get("dtype") == hf_torch_dtype
        and len(hf_result["outputs"]) == len(prompts)
    ):
        hf = hf_result
    else:
        hf = time_hf_generate(
            runtime.folder,
            prompts,
            max_new_tokens,
            dtype=hf_torch_dtype,
            trust_remote_code=runtime.trust_remote_code,
        )
    return hf, hf_torch_dtype, hf_reason, lossless
