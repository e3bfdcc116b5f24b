"""Serving command: generate (stream a completion), and the flag groups and runtime loading it
shares with ``bench`` (:mod:`draftsmith.cli.bench_flags`, :mod:`draftsmith.cli.bench_modes`),
plus two helpers the bench modes call (the llama.cpp parity runner and the block-diffusion target
test)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draftsmith.cli.arguments import (
    COUNT,
    SEED,
    TEMPERATURE,
    served_dtype,
    stop_policy,
)
from draftsmith.cli.preflight import add_trust_flag, check_new_tokens_fit, refuse_bad_exports


def add_target_flags(p: argparse.ArgumentParser) -> None:
    """The target and how it runs: --target, --dtype, --kernels, --backend, --linear-backend,
    --temperature, --max-new-tokens, --trust-remote-code."""
    p.add_argument(
        "--target", default=None, help="target folder (default: the one recorded in the export)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        type=served_dtype,
        help=(
            "auto (bf16 where this machine runs it fast: AVX512-BF16, or the fused layer's AVX2"
            " variant; else fp32) | fp32 (exact) | bf16"
        ),
    )
    p.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "lean", "hf"],
        help=(
            "target decoder: auto (the lean decoder where it supports the model, else the"
            " transformers fallback; --verbose and bench say which and why) | lean | hf"
        ),
    )
    p.add_argument(
        "--linear-backend",
        default="auto",
        choices=["auto", "cpp", "mkldnn", "dense"],
        help=(
            "auto (the fastest this CPU can run) | cpp (fused C++ bf16 layer: AVX512-BF16 or"
            " AVX2+FMA) | mkldnn (oneDNN bf16: AVX512 BW/VL/DQ or AVX-NE-CONVERT) | dense"
        ),
    )
    p.add_argument("--temperature", type=TEMPERATURE, default=0.0)
    p.add_argument("--max-new-tokens", type=COUNT, default=128)
    add_trust_flag(p)


def add_verifier_flag(p: argparse.ArgumentParser) -> None:
    """--verifier: how drafted (or sampled) tokens are accepted."""
    p.add_argument(
        "--verifier",
        default="auto",
        choices=["auto", "greedy", "rejection", "typical"],
        help="auto | greedy | rejection | typical (lossy)",
    )


def add_drafting_flags(p: argparse.ArgumentParser) -> None:
    """How an export drafts: --stop-policy and --proposer-option."""
    p.add_argument(
        "--stop-policy",
        default="auto",
        type=stop_policy,
        help=(
            "auto (the export's policy, its depth chosen for this machine's measured costs: plain"
            " decoding when speculation is predicted to lose) | export (exactly the export's"
            " inference.stop_policy) | fixed:K | confidence:THRESHOLD[:MAX_DEPTH] |"
            " learned:H[:MIN_DEPTH:MAX_DEPTH] (SpecDec++ exports) | none"
        ),
    )
    p.add_argument(
        "--proposer-option",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help=(
            "override an export's inference default, e.g. total_tokens=6 depth=2 policy=chain"
            " (EAGLE) or tree='[[0],[1],[0,0]]' (Medusa); repeatable"
        ),
    )


def add_serving_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of serving an export on its target (generate, bench export and bench
    controller)."""
    add_target_flags(p)
    add_verifier_flag(p)
    add_drafting_flags(p)


def _generate_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("--drafter", default=None, help="export folder of a trained drafter")
    g.add_argument(
        "--controller",
        default=None,
        help=(
            "adaptive-temperature export: sample each position at the layer's temperature (with "
            "--drafter, speculative sampling verifies against that tempered target exactly)"
        ),
    )
    g.add_argument("--prompt", required=True)
    g.add_argument("--seed", type=SEED, default=0)
    g.add_argument(
        "--verbose",
        action="store_true",
        help="say on stderr which CPU, dtype and backends run, and why",
    )
    add_serving_flags(g)


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream decoded text to stdout."""
    import torch

    from draftsmith.common.chat import encode_chat
    from draftsmith.runtime.decoding.autoregressive import generate_ar
    from draftsmith.runtime.decoding.prompt_limits import check_prompt_fits, context_limit

    refuse_bad_exports(args)
    rt = runtime_from_flags(args)
    if args.verbose:
        for key, value in rt.backend_report().items():
            print(f"[{key}] {value}", file=sys.stderr)
    if rt.speculative is not None and args.stop_policy == "auto":
        from draftsmith.runtime.shapes import shape_cache

        note = shape_cache.apply_cached_shape(rt)
        if args.verbose or "plain decoding" in note:
            print(f"[draft shape] {note}", file=sys.stderr)
    prompt = encode_chat(rt.tokenizer, args.prompt)
    limit = context_limit(rt.model)
    if limit is not None:
        check_prompt_fits(len(prompt), limit, "the prompt")
        check_new_tokens_fit(len(prompt), args.max_new_tokens, limit, "the prompt")
    generator = torch.Generator().manual_seed(args.seed)
    stream = _text_streamer(rt.tokenizer)
    if rt.speculative is not None:
        result = rt.speculative.generate(
            prompt, args.max_new_tokens, eos_ids=rt.eos_ids, generator=generator, stream=stream
        )
        print(f"\n[tau {result.tau:.2f} over {result.steps} target forwards]", file=sys.stderr)
    else:
        generate_ar(
            rt.model,
            prompt,
            args.max_new_tokens,
            temperature=args.temperature,
            eos_ids=rt.eos_ids,
            generator=generator,
            stream=stream,
        )
        print()
    return 0


def runtime_from_flags(args: argparse.Namespace) -> Any:
    """The runtime the serving flags (:func:`add_serving_flags`) and ``--drafter`` /
    ``--controller`` describe (``generate`` and ``bench`` load it alike)."""
    from draftsmith.runtime.serving import load_runtime, parse_options

    return load_runtime(
        args.drafter,
        args.target,
        args.dtype,
        args.kernels,
        args.verifier,
        args.temperature,
        proposer_options=parse_options(args.proposer_option),
        linear_backend=args.linear_backend,
        stop_policy=args.stop_policy,
        controller=getattr(args, "controller", None),
        backend=args.backend,
        trust_remote_code=args.trust_remote_code,
    )


def _text_streamer(tokenizer: Any) -> Callable[[int | list[int]], None]:
    """A ``stream`` callback that prints the text of the tokens emitted so far as it grows (decoded
    whole each time, so a token that completes a multi-byte character prints it once)."""
    emitted: list[int] = []
    printed = ""

    def stream(tokens: int | list[int]) -> None:
        nonlocal printed
        emitted.extend([tokens] if isinstance(tokens, int) else tokens)
        text = tokenizer.decode(emitted, skip_special_tokens=True)
        sys.stdout.write(text[len(printed) :])
        sys.stdout.flush()
        printed = text

    return stream


def _llamacpp_parity(route: Any, request: Any) -> dict[str, Any]:
    """Both taus for ``bench --engine-parity`` from ``draftsmith engine-check``
    (:mod:`draftsmith.evals.engine_check`) on a temporary GGUF conversion of the export: llama.cpp's
    speculative tool and our runtime's greedy chain.
    """
    import tempfile

    from draftsmith.cli.engines import _gguf_files
    from draftsmith.evals.engine_check import engine_check

    with tempfile.TemporaryDirectory(prefix="draftsmith-parity-") as tmp:
        paths = _gguf_files(request.export, None, tmp)
        check = engine_check(
            request.export,
            paths["target"],
            paths["draft"],
            request.prompts,
            request.num_prompts,
            request.max_new_tokens,
            request.chain,
            request.threads,
            request.dtype,
        )
    engine = check["llamacpp"]
    return {
        "tau_ours": check["runtime"]["tau"],
        "tau_engine": engine["speculative"]["tau"],
        "chain": engine["speculative"]["n_draft_max"],
        "engine_lossless": engine["lossless"],
        "engine_near_ties_only": engine["near_ties_only"],
        "ours_lossless": check["runtime"]["lossless"],
        "acceptance_ours": check["runtime"]["acceptance"],
        "acceptance_engine": engine["speculative"]["acceptance"],
        "prompt_ids_match": check["prompt_ids_match"],
        "version": check["version"],
    }


def _is_diffusion_target(target: str | None) -> bool:
    """Whether ``target`` is a diffusion-LM folder (its config.json carries the diffusion block, or
    it is a known published family: LLaDA, Dream)."""
    from draftsmith.runtime.target.diffusion_lm import DIFFUSION_KEY, REMOTE_FAMILIES
    from draftsmith.runtime.target.weights import load_hf_config

    config = Path(target) / "config.json" if target else None
    if not (config and config.is_file()):
        return False
    raw = load_hf_config(target)  # a corrupt config.json: named, with what to do
    return DIFFUSION_KEY in raw or str(raw.get("model_type", "")).lower() in REMOTE_FAMILIES


# command -> what a Ctrl-C kept, for the one line :func:`draftsmith.cli.main` prints
KEPT = {"generate": lambda args: "the text printed so far; nothing was written to disk"}
ARGUMENTS = {"generate": _generate_arguments}
HANDLERS = {"generate": cmd_generate}
