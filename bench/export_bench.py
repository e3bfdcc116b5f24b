"""``draftsmith bench export``: an export's speed, tau and lossless check, then what the flags add
(llama.cpp peers, engine parity, an oracle beside it), each a phase with progress lines
(:mod:`draftsmith.bench.progress`); printed, and bench.json / bench.md / acceptance.png in
``--out``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from draftsmith.bench import progress
from draftsmith.runtime.serving import Runtime


def _lossless_first(
    args: argparse.Namespace, rt: Runtime, prompts: list[list[int]]
) -> dict[str, Any] | None:
    """The separate lossless check (fp32 by default) when the timing dtype is another one; None
    otherwise."""
    from draftsmith.bench.served import lossless_check
    from draftsmith.runtime.serving import parse_options, resolve_dtype

    check = args.lossless_dtype
    if not (
        args.temperature == 0
        and check not in ("none", "same")
        and resolve_dtype(check) != rt.model.dtype
    ):
        return None
    return lossless_check(
        args.drafter,
        args.target,
        prompts,
        args.max_new_tokens,
        check,
        args.kernels,
        proposer_options=parse_options(args.proposer_option),
        backend=args.backend,
        stop_policy=args.stop_policy,
    )  # auto/export: the export's own (it drafts)


def _additions(
    args: argparse.Namespace,
    rt: Runtime,
    prompts: list[list[int]],
    result: dict[str, Any],
    parity_runner: Callable[..., dict[str, Any]],
) -> None:
    """What the flags add to ``result``: llama.cpp peers, engine parity, the oracle beside the
    drafter."""
    phases = progress.current()
    if args.llamacpp:
        from draftsmith.bench.llamacpp import llamacpp_peers

        result["peers"] = {
            "llamacpp": phases.run(
                "llama.cpp peers",
                lambda: llamacpp_peers(
                    prompts,
                    rt.tokenizer,
                    args.max_new_tokens,
                    result["threads"],
                    rt.folder,
                    result["tokens_per_s"]["runtime_ar"],
                ),
            )
        }
    if args.engine_parity:
        from draftsmith.bench.engine_parity import ParityRequest, engine_parity

        request = ParityRequest(
            args.drafter,
            args.prompts,
            args.num_prompts,
            args.max_new_tokens,
            args.parity_chain,
            result["threads"],
            args.dtype,
        )
        result["engine_parity"] = phases.run(
            "engine parity",
            lambda: engine_parity(result["method"], request, {"llamacpp": parity_runner}),
        )
    # the loop's ceiling at a chosen acceptance, beside this drafter
    if args.oracle_acceptance is not None:
        from draftsmith.bench.oracle import oracle_beside

        result["oracle"] = phases.run(
            "oracle beside the drafter", lambda: oracle_beside(args, rt, prompts)
        )


def bench_export(
    args: argparse.Namespace,
    rt: Runtime,
    prompts: list[list[int]],
    parity_runner: Callable[..., dict[str, Any]],
) -> int:
    """Run the export bench on the loaded runtime ``rt`` (``parity_runner``: the llama.cpp runner of
    ``--engine-parity``, from the CLI: bench/ never imports evals/)."""
    from draftsmith.bench.report import markdown_table, write_outputs
    from draftsmith.bench.run import run_bench

    lossless = _lossless_first(args, rt, prompts)
    # checked >= 0
    sweep = [int(k) for k in args.sweep_k.split(",") if k.strip()] if args.sweep_k else None
    result = run_bench(
        rt,
        prompts,
        args.max_new_tokens,
        skip_hf=args.skip_hf,
        temperature=args.temperature,
        lossless=lossless,
        hf_dtype=args.hf_dtype,
        cost_aware=args.stop_policy == "auto",
        profile=args.profile,
        sweep_k=sweep,
        window=args.window,
        check_lossless=args.lossless_dtype != "none",
    )
    _additions(args, rt, prompts, result, parity_runner)
    result["phases"] = dict(
        progress.current().times
    )  # every phase, the load and the additions included
    progress.current().remember()  # the next bench's ETAs for the phases that count nothing
    print(markdown_table(result))
    if args.out:
        out = write_outputs(result, args.out)
        print(f"wrote {out / 'bench.json'}, bench.md, acceptance.png")
    else:
        print(
            json.dumps(
                {k: result[k] for k in ("tau", "tokens_per_s", "speedup", "lossless", "backend")},
                indent=2,
            )
        )
    return 0


__all__ = ["bench_export"]
