"""Serving commands: generate (stream a completion) and bench (prove an export: speed, tau, lossless; also the
reward and block-diffusion benches, chosen by the arguments)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from draftsmith.cli.arguments import (
    COUNT,
    PROBABILITY,
    SEED,
    TEMPERATURE,
    Range,
    counts,
    number_list,
    served_dtype,
    stop_policy,
)
from draftsmith.cli.oracle_flags import add_oracle_arguments
from draftsmith.cli.preflight import check_writable_folder, refuse_bad_exports


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target folder (default: the one recorded in the export)")
    p.add_argument("--dtype", default="auto", type=served_dtype,
                   help="auto (bf16 where this machine runs it fast: AVX512-BF16, or the fused layer's AVX2 variant; "
                        "else fp32) | fp32 (exact) | bf16")
    p.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--backend", default="auto", choices=["auto", "lean", "hf"],
                   help="target decoder: auto (the lean decoder where it supports the model, else the transformers "
                        "fallback; --verbose and bench say which and why) | lean | hf")
    p.add_argument("--linear-backend", default="auto", choices=["auto", "cpp", "mkldnn", "dense"],
                   help="auto (the fastest this CPU can run) | cpp (fused C++ bf16 layer: AVX512-BF16 or AVX2+FMA) | "
                        "mkldnn (oneDNN bf16: AVX512 BW/VL/DQ or AVX-NE-CONVERT) | dense")
    p.add_argument("--temperature", type=TEMPERATURE, default=0.0)
    p.add_argument("--verifier", default="auto", choices=["auto", "greedy", "rejection", "typical"],
                   help="auto | greedy | rejection | typical (lossy)")
    p.add_argument("--max-new-tokens", type=COUNT, default=128)
    p.add_argument("--stop-policy", default="auto", type=stop_policy,
                   help="auto (the export's policy, its depth chosen for this machine's measured costs: plain decoding "
                        "when speculation is predicted to lose) | export (exactly the export's inference.stop_policy) "
                        "| fixed:K | confidence:THRESHOLD[:MAX_DEPTH] | learned:H[:MIN_DEPTH:MAX_DEPTH] (SpecDec++ "
                        "exports) | none")
    p.add_argument("--proposer-option", action="append", default=None, metavar="KEY=VALUE",
                   help="override an export's inference default, e.g. total_tokens=6 depth=2 policy=chain (EAGLE) "
                        "or tree='[[0],[1],[0,0]]' (Medusa); repeatable")


def _generate_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("--drafter", default=None, help="export folder of a trained drafter")
    g.add_argument("--controller", default=None,
                   help="adaptive-temperature export: sample each position at the layer's temperature (with "
                        "--drafter, speculative sampling verifies against that tempered target exactly)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--seed", type=SEED, default=0)
    g.add_argument("--verbose", action="store_true", help="say on stderr which CPU, dtype and backends run, and why")
    _add_common(g)


def _bench_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--drafter", default=None, help="export folder of a trained drafter")
    b.add_argument("--controller", default=None,
                   help="adaptive-temperature export(s), comma-separated: tokens/s with and without the layer (its "
                        "overhead); on a reward task (--prompts embedded[:split] or --reward) also the mean reward of "
                        "each layer and of every fixed temperature of its grid, per prompt kind, with 95%% intervals")
    b.add_argument("--prompts", default="mtbench",
                   help="mtbench, humaneval or a .jsonl with 'prompt' (or 'turns'); with --controller also "
                        "embedded[:train|heldout|all] (the mixed reward task) or a .jsonl of {text, kind?, answer?}")
    b.add_argument("--reward", default=None, help="with --controller: score rewards with this reward (embedded, "
                   "exact_match, open_ended or pkg.module:function; default embedded on the embedded task)")
    b.add_argument("--samples-per-prompt", type=COUNT, default=4, help="with a reward: responses sampled per prompt")
    b.add_argument("--grid", default=None, type=number_list(TEMPERATURE, "temperatures"),
                   help="with a reward: the fixed temperatures compared (default: the "
                   "controllers' grid, else 0,0.2,...,1)")
    b.add_argument("--overhead-prompts", type=COUNT, default=8, help="with a reward: prompts timed for the overhead")
    b.add_argument("--seed", type=SEED, default=0)
    b.add_argument("--filter", default=None, help="Learn2PD export: with a block-diffusion --target, bench baseline, "
                   "Learn2PD, EoTP and both (the one block-diffusion bench)")
    b.add_argument("--cache", default="off", choices=["off", "on", "both"],
                   help="block-diffusion bench: prefix KV cache across finished blocks off, on, or every mode both "
                        "ways")
    b.add_argument("--gen-length", type=COUNT, default=256, help="block-diffusion bench: answer slots per prompt")
    b.add_argument("--steps-per-block", type=counts("leave it out for one step per block position"), default=None,
                   help="block-diffusion bench: denoising steps per block (default: the block length)")
    b.add_argument("--threshold", type=PROBABILITY, default=None,
                   help="block-diffusion bench: the Learn2PD filter's acceptance threshold (default: the exported one)")
    b.add_argument("--trust-remote-code", action="store_true",
                   help="block-diffusion bench: allow a target whose modelling code ships with it (LLaDA, Dream)")
    b.add_argument("--num-prompts", type=counts("leave it out to use every prompt"), default=None,
                   help="use the first N prompts")
    b.add_argument("--out", default=None, help="folder for bench.json, bench.md, acceptance.png")
    b.add_argument("--skip-hf", action="store_true", help="do not time HF generate")
    b.add_argument("--profile", action="store_true",
                   help="time each part of a speculative step (drafting, verify forward, verification, KV, update)")
    b.add_argument("--sweep-k", default=None, type=number_list(Range(int, low=0), "draft depths"),
                   metavar="K1,K2,...",
                   help="also time fixed draft depths K on the same prompts, next to the policy in force")
    b.add_argument("--hf-dtype", default="auto", choices=["auto", "same", "fp32", "bf16"],
                   help="dtype HF generate is timed in: auto (its fastest here: bf16 where native, else fp32) | same "
                        "(the runtime's) | fp32 | bf16")
    b.add_argument("--lossless-dtype", default="fp32", choices=["fp32", "bf16", "same", "none"],
                   help="dtype of the lossless check (greedy spec vs HF generate); 'same' = the timing dtype, "
                        "'none' = skip")
    b.add_argument("--llamacpp", action="store_true",
                   help="also time llama.cpp greedy on the same prompts and threads (`make llamacpp` builds it once): "
                        "the shipped Q4_1 GGUF and a BF16 GGUF converted from the target (peers.llamacpp)")
    b.add_argument("--window", type=COUNT, default=None, metavar="TOKENS",
                   help="output tokens per window of tau by output window (bench.json tau_by_window; default 256)")
    b.add_argument("--long", action="store_true", help="long outputs, so acceptance decay shows: 2 prompts x 2048 "
                   "new tokens, window 256 (each where not given); generation still stops at EOS")
    b.add_argument("--engine-parity", action="store_true",
                   help="also run the export in each engine in reach that runs its method (llama.cpp: EAGLE-3, DFlash) "
                        "on the same prompts and drafted chain: tau ours vs tau in the engine; a gap over 5%% is a "
                        "defect of the export (bench.json engine_parity)")
    b.add_argument("--parity-chain", type=COUNT, default=None, help="with --engine-parity: tokens drafted per step in "
                   "both engines (default: 4; DFlash: block_size - 1)")
    add_oracle_arguments(b)
    _add_common(b)
    b.set_defaults(max_new_tokens=None)  # 128, or --long's 2048 (bench.windows.apply_preset)


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream decoded text to stdout."""
    import torch

    from draftsmith.common.chat import encode_chat
    from draftsmith.runtime.decoding.autoregressive import generate_ar
    from draftsmith.runtime.decoding.prompt_limits import check_prompt_fits, context_limit
    from draftsmith.runtime.serving import load_runtime, parse_options

    refuse_bad_exports(args)
    rt = load_runtime(args.drafter, args.target, args.dtype, args.kernels, args.verifier, args.temperature,
                      proposer_options=parse_options(args.proposer_option), linear_backend=args.linear_backend,
                      stop_policy=args.stop_policy, controller=args.controller, backend=args.backend)
    if args.verbose:
        for key, value in rt.backend_report().items():
            print(f"[{key}] {value}", file=sys.stderr)
    if rt.speculative is not None and args.stop_policy == "auto":
        from draftsmith.runtime.acceptance import depth_choice

        note = depth_choice.apply_cached_shape(rt)
        if args.verbose or "plain decoding" in note:
            print(f"[draft shape] {note}", file=sys.stderr)
    prompt = encode_chat(rt.tokenizer, args.prompt)
    limit = context_limit(rt.model)
    if limit is not None:
        check_prompt_fits(len(prompt), limit, "the prompt")
    generator = torch.Generator().manual_seed(args.seed)
    emitted: list[int] = []
    printed = ""

    def stream(tokens: int | list[int]) -> None:
        nonlocal printed
        emitted.extend([tokens] if isinstance(tokens, int) else tokens)
        text = rt.tokenizer.decode(emitted, skip_special_tokens=True)
        sys.stdout.write(text[len(printed):])
        sys.stdout.flush()
        printed = text

    if rt.speculative is not None:
        result = rt.speculative.generate(prompt, args.max_new_tokens, eos_ids=rt.eos_ids, generator=generator,
                                         stream=stream)
        print(f"\n[tau {result.tau:.2f} over {result.steps} target forwards]", file=sys.stderr)
    else:
        generate_ar(rt.model, prompt, args.max_new_tokens, temperature=args.temperature, eos_ids=rt.eos_ids,
                    generator=generator, stream=stream)
        print()
    return 0


def is_reward_task(args: argparse.Namespace) -> bool:
    """Whether ``bench`` scores rewards: the embedded mixed task or an explicit ``--reward``."""
    return str(args.prompts).startswith("embedded") or args.reward is not None


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write JSON/markdown/PNG with --out."""
    from draftsmith.bench.oracle import bench_oracle_alone, oracle_request
    from draftsmith.bench.prompts import load_prompts
    from draftsmith.bench.windows import apply_preset
    from draftsmith.runtime.decoding.prompt_limits import context_limit
    from draftsmith.runtime.serving import load_runtime, parse_options

    apply_preset(args)
    refuse_bad_exports(args)
    if args.out:
        check_writable_folder(args.out)  # before the bench, not after it
    if (oracle := oracle_request(args)) and not args.drafter:  # the --oracle-* flags checked together
        return bench_oracle_alone(args, oracle)
    if args.engine_parity and not args.drafter:
        raise ValueError("--engine-parity compares a drafter's tau across engines: it needs --drafter EXPORT")
    if args.filter or _is_diffusion_target(args.target):
        return _bench_diffusion(args)
    if is_reward_task(args):
        if args.drafter:
            raise ValueError("a reward bench takes --controller (or nothing: fixed temperatures only), not --drafter "
                             "(a drafter does not change the output distribution); bench its speed separately")
        from draftsmith.evals.reward_bench import cmd_reward_bench

        return cmd_reward_bench(args)
    if not args.drafter and not args.controller:
        raise ValueError("bench needs --drafter EXPORT (a drafter), --controller EXPORT (a temperature layer), or a "
                         "reward task (--prompts embedded:heldout) to compare fixed temperatures")
    if args.controller:
        if "," in args.controller:
            raise ValueError("several --controller exports are compared on a reward task only (--prompts "
                             "embedded:heldout or --reward NAME)")
    rt = load_runtime(args.drafter, args.target, args.dtype, args.kernels, args.verifier, args.temperature,
                      proposer_options=parse_options(args.proposer_option), linear_backend=args.linear_backend,
                      stop_policy=args.stop_policy, controller=args.controller, backend=args.backend)
    prompts = load_prompts(args.prompts, rt.tokenizer, args.num_prompts, max_len=context_limit(rt.model))
    if args.controller:
        return _bench_controller_layer(args, rt, prompts)
    return _bench_drafter(args, rt, prompts)


def _bench_diffusion(args: argparse.Namespace) -> int:
    """``bench --filter`` or a block-diffusion ``--target``: the Learn2PD filter bench
    (:mod:`draftsmith.evals.diffusion`)."""
    from argparse import Namespace

    from draftsmith.evals.diffusion import run_cli

    if args.drafter or args.controller:
        raise ValueError("a block-diffusion target is benched with --filter (Learn2PD) only, not with --drafter or "
                         "--controller")
    if not args.target:
        raise ValueError("--filter needs --target DIFFUSION_TARGET (recipe=diffusion_adapt's <run dir>/export)")
    run_cli(Namespace(target=args.target, filter=args.filter, prompts=args.prompts, limit=args.num_prompts,
                      gen_length=args.gen_length, steps_per_block=args.steps_per_block, threshold=args.threshold,
                      cache=args.cache, temperature=args.temperature,
                      dtype="fp32" if args.dtype == "auto" else args.dtype, threads=None,
                      trust_remote_code=args.trust_remote_code,
                      out=str(Path(args.out) / "diffusion_bench.json") if args.out else None))
    return 0


def _bench_controller_layer(args: argparse.Namespace, rt: Any, prompts: list[list[int]]) -> int:
    """``bench --controller EXPORT``: the temperature layer's overhead (printed; ``controller.json`` in --out)."""
    from draftsmith.bench.controller import bench_controller, controller_table

    result = bench_controller(rt, prompts, args.max_new_tokens)
    print(controller_table(result))
    if args.out:
        from draftsmith.common.atomic_folder import write_file

        write_file(Path(args.out) / "controller.json", json.dumps(result, indent=2) + "\n")
    return 0


def _bench_drafter(args: argparse.Namespace, rt: Any, prompts: list[list[int]]) -> int:
    """``bench --drafter EXPORT``: speed, tau and the lossless check (printed; JSON/markdown/PNG in --out)."""
    from draftsmith.bench.report import markdown_table, write_outputs
    from draftsmith.bench.run import run_bench
    from draftsmith.bench.served import lossless_check
    from draftsmith.runtime.serving import parse_options, resolve_dtype

    lossless = None
    check = args.lossless_dtype
    if args.temperature == 0 and check not in ("none", "same") and resolve_dtype(check) != rt.model.dtype:
        lossless = lossless_check(args.drafter, args.target, prompts, args.max_new_tokens, check, args.kernels,
                                  proposer_options=parse_options(args.proposer_option), backend=args.backend,
                                  stop_policy=args.stop_policy)  # auto/export: the export's (it drafts)
    sweep = [int(k) for k in args.sweep_k.split(",") if k.strip()] if args.sweep_k else None  # checked >= 0
    result = run_bench(rt, prompts, args.max_new_tokens, skip_hf=args.skip_hf, temperature=args.temperature,
                       lossless=None if check == "none" else lossless, hf_dtype=args.hf_dtype,
                       cost_aware=args.stop_policy == "auto", profile=args.profile, sweep_k=sweep, window=args.window)
    if check == "none":
        result["lossless"] = None
    if args.llamacpp:
        from draftsmith.bench.llamacpp import llamacpp_peers

        result["peers"] = {"llamacpp": llamacpp_peers(prompts, rt.tokenizer, args.max_new_tokens, result["threads"],
                                                      rt.folder, result["tokens_per_s"]["runtime_ar"])}
    if args.engine_parity:
        from draftsmith.bench.engine_parity import ParityRequest, engine_parity

        request = ParityRequest(args.drafter, args.prompts, args.num_prompts, args.max_new_tokens, args.parity_chain,
                                result["threads"], args.dtype)
        result["engine_parity"] = engine_parity(result["method"], request, {"llamacpp": _llamacpp_parity})
    if args.oracle_acceptance is not None:  # the loop's ceiling at a chosen acceptance, beside this drafter
        from draftsmith.bench.oracle import oracle_beside

        result["oracle"] = oracle_beside(args, rt, prompts)
    print(markdown_table(result))
    if args.out:
        out = write_outputs(result, args.out)
        print(f"wrote {out / 'bench.json'}, bench.md, acceptance.png")
    else:
        print(json.dumps({k: result[k] for k in ("tau", "tokens_per_s", "speedup", "lossless", "backend")}, indent=2))
    return 0


def _llamacpp_parity(route: Any, request: Any) -> dict[str, Any]:
    """Both taus for ``bench --engine-parity`` from ``draftsmith engine-check`` (:mod:`draftsmith.evals.engine_check`)
    on a temporary GGUF conversion of the export: llama.cpp's speculative tool and our runtime's greedy chain."""
    import tempfile

    from draftsmith.cli.engines import _gguf_files
    from draftsmith.evals.engine_check import engine_check

    with tempfile.TemporaryDirectory(prefix="draftsmith-parity-") as tmp:
        paths = _gguf_files(request.export, None, tmp)
        check = engine_check(request.export, paths["target"], paths["draft"], request.prompts, request.num_prompts,
                             request.max_new_tokens, request.chain, request.threads, request.dtype)
    engine = check["llamacpp"]
    return {"tau_ours": check["runtime"]["tau"], "tau_engine": engine["speculative"]["tau"],
            "chain": engine["speculative"]["n_draft_max"],
            "engine_lossless": engine["lossless"], "ours_lossless": check["runtime"]["lossless"],
            "acceptance_ours": check["runtime"]["acceptance"], "acceptance_engine": engine["speculative"]["acceptance"],
            "prompt_ids_match": check["prompt_ids_match"], "version": check["version"]}


def _is_diffusion_target(target: str | None) -> bool:
    """Whether ``target`` is a diffusion-LM folder (its config.json carries the diffusion block, or it is a known
    published family: LLaDA, Dream)."""
    from draftsmith.runtime.target.diffusion_lm import DIFFUSION_KEY, REMOTE_FAMILIES
    from draftsmith.runtime.target.weights import load_hf_config

    config = Path(target) / "config.json" if target else None
    if not (config and config.is_file()):
        return False
    raw = load_hf_config(target)  # a corrupt config.json: named, with what to do
    return DIFFUSION_KEY in raw or str(raw.get("model_type", "")).lower() in REMOTE_FAMILIES


def _bench_kept(args: argparse.Namespace) -> str:
    """What an interrupted ``bench`` kept: nothing (its outputs are written at the end, each file atomically)."""
    where = f" to {args.out}" if args.out else ""
    return f"nothing was written{where} (a bench writes its results at the end; files there before are unchanged)"


# command -> what a Ctrl-C kept, for the one line :func:`draftsmith.cli.main` prints
KEPT = {"generate": lambda args: "the text printed so far; nothing was written to disk", "bench": _bench_kept}
ARGUMENTS = {"generate": _generate_arguments, "bench": _bench_arguments}
HANDLERS = {"generate": cmd_generate, "bench": cmd_bench}
