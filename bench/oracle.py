"""``bench --oracle-acceptance P --oracle-chain K``: the speculative loop's ceiling at a chosen
acceptance, measured on this machine through the runtime's own loop
(:class:`~draftsmith.runtime.drafting.oracle.OracleProposer`: verify, acceptance and KV commit
unchanged), beside the real drafter's row in ``bench.json`` (``oracle``) and the table, or alone on
a target (no ``--drafter``).

Per prompt: a plain greedy decode gives the reference the oracle drafts from; an untimed rehearsal
(also the warm-up) replaces a reference wherever the loop's own greedy tokens differ from it (a bf16
verify block can flip a near-tie); then plain decoding and the oracle are timed interleaved, prompt
by prompt, so the speedup is not the machine's drift.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.bench import progress
from draftsmith.bench.timing import compare_outputs, speedup_ci, time_interleaved
from draftsmith.common.errors import InputError
from draftsmith.runtime.acceptance.verifiers import GreedyVerifier
from draftsmith.runtime.decoding import metrics
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.oracle import OracleProposer, check_oracle, expected_tau
from draftsmith.runtime.serving import Runtime
from draftsmith.runtime.target.interface import TargetDecoder

# chains of 3-4 are the useful shapes on a 2-core CPU (verify cost grows past them)
DEFAULT_CHAIN = 3
REHEARSALS = 3  # untimed passes at most to settle the references (fp32 settles in one)
CHECK_ACCEPTANCE, CHECK_CHAIN = (
    0.8,
    4,
)  # the lossless check's oracle: mostly accepted chains of 4 (tau ~3.4)


@dataclass(frozen=True)
class OracleRequest:
    """What the oracle drafts: per-position acceptance ``acceptance`` (given the previous position
    was right), a chain of ``chain`` tokens, ``draft_ms`` of simulated cost per draft call, and the
    seed of its draws.
    """

    acceptance: float
    chain: int = DEFAULT_CHAIN
    draft_ms: float = 0.0
    seed: int = 0


def oracle_request(args: argparse.Namespace) -> OracleRequest | None:
    """The oracle the bench command line asks for, checked before anything loads (one-line
    ValueErrors); None when ``--oracle-acceptance`` is not given."""
    p, k, ms = args.oracle_acceptance, args.oracle_chain, args.oracle_draft_ms or 0.0
    if p is None:
        if k is not None or ms:
            raise InputError(
                "--oracle-chain and --oracle-draft-ms go with --oracle-acceptance P (the oracle's "
                "per-position acceptance)"
            )
        return None
    chain = DEFAULT_CHAIN if k is None else k
    check_oracle(p, chain, ms)
    if getattr(args, "temperature", 0.0):
        raise InputError(
            "--oracle-acceptance measures greedy decoding (the oracle drafts the greedy"
            " continuation): leave --temperature at 0"
        )
    reward = str(getattr(args, "prompts", "")).startswith("embedded") or getattr(
        args, "reward", None
    )
    if getattr(args, "controller", None) or getattr(args, "filter", None) or reward:
        raise InputError(
            "--oracle-acceptance benches the speculative loop: run it alone or with --drafter, not"
            " with --controller, --filter or a reward task"
        )
    return OracleRequest(float(p), int(chain), float(ms), int(getattr(args, "seed", 0) or 0))


def oracle_beside(
    args: argparse.Namespace, runtime: Runtime, prompts: list[list[int]]
) -> dict[str, Any]:
    """``bench --drafter EXPORT --oracle-acceptance P``: the oracle's row on the drafter's prompts
    and target."""
    request = oracle_request(args)
    if request is None:
        raise InputError("the oracle's row needs --oracle-acceptance P")
    return run_oracle(
        runtime.model, runtime.eos_ids, prompts, args.max_new_tokens, request, args.kernels
    )


def run_oracle(
    model: TargetDecoder,
    eos_ids: tuple[int, ...],
    prompts: list[list[int]],
    max_new_tokens: int,
    request: OracleRequest,
    kernels: str = "auto",
) -> dict[str, Any]:
    """Time plain decoding and the oracle on ``prompts`` with the runtime decoder ``model``
    (greedy); the result is bench.json's ``oracle`` section."""
    # K tokens past the limit, so the last step's chain drafts known tokens too
    plain = [
        generate_ar(model, p, max_new_tokens + request.chain, eos_ids=eos_ids) for p in prompts
    ]
    oracle = OracleProposer(
        {tuple(p): ref for p, ref in zip(prompts, plain)},
        request.acceptance,
        request.chain,
        request.draft_ms,
        request.seed,
    )
    model.check_speculative()  # the HF fallback verifies trees exactly or refuses
    spec = SpeculativeDecoder(model, oracle, GreedyVerifier(kernels), kernel_backend=kernels)
    rehearsals = _settle_references(spec, oracle, prompts, max_new_tokens, eos_ids)
    oracle.diverged, results = 0, []

    def decode(prompt: list[int]) -> list[int]:
        results.append(spec.generate(prompt, max_new_tokens, eos_ids=eos_ids))
        return results[-1].tokens

    timed = time_interleaved(
        {
            "runtime_ar": lambda p: generate_ar(model, p, max_new_tokens, eos_ids=eos_ids),
            "speculative": decode,
        },
        prompts,
    )
    ar, sp = timed["runtime_ar"], timed["speculative"]
    accepted = [a for r in results for a in r.accepted_per_step]
    depths = [d for r in results for d in r.depths]
    same = compare_outputs(ar["outputs"], sp["outputs"])
    return {
        **asdict(request),
        "expected_tau": expected_tau(request.acceptance, request.chain),
        "tau": metrics.tau(accepted),
        "acceptance_by_position": metrics.acceptance_by_position(accepted, depths),
        "steps": len(accepted),
        "tokens": sp["tokens"],
        "tokens_per_s": {"runtime_ar": ar["tokens_per_s"], "speculative": sp["tokens_per_s"]},
        "speedup_vs_ar": sp["tokens_per_s"] / ar["tokens_per_s"],
        "speedup_vs_ar_ci95": list(speedup_ci(ar, sp)),
        "lossless": same["all_identical"],
        "lossless_detail": {
            "dtype": str(model.dtype).replace("torch.", ""),
            "reference": "runtime_ar",
            **same,
        },
        "diverged_prompts": oracle.diverged,
        "rehearsals": rehearsals,
    }


def oracle_lossless(
    model: TargetDecoder,
    eos_ids: tuple[int, ...],
    prompts: list[list[int]],
    max_new_tokens: int,
    reference: list[list[int]],
    kernels: str = "auto",
) -> dict[str, Any]:
    """The lossless check's second proposer, beside the real drafter: the oracle drafting the
    target's own greedy continuation (plain decoding's, ``CHECK_CHAIN`` tokens past the limit),
    right at each position with probability ``CHECK_ACCEPTANCE``, so verification accepts drafts on
    most steps even where the real drafter is weak (a short training run drafts tau 1.0-1.1: the
    accept path runs a few times a prompt). Its greedy speculative outputs are compared with
    ``reference`` (HF ``generate``'s, or whatever the drafter was compared with)."""
    plain = []
    for prompt in prompts:
        plain.append(generate_ar(model, prompt, max_new_tokens + CHECK_CHAIN, eos_ids=eos_ids))
        progress.step()
    oracle = OracleProposer(
        {tuple(p): ref for p, ref in zip(prompts, plain)}, CHECK_ACCEPTANCE, CHECK_CHAIN
    )
    model.check_speculative()  # the HF fallback verifies trees exactly or refuses
    spec = SpeculativeDecoder(model, oracle, GreedyVerifier(kernels), kernel_backend=kernels)
    results = []
    for prompt in prompts:
        results.append(spec.generate(prompt, max_new_tokens, eos_ids=eos_ids))
        progress.step()
    accepted = [a for r in results for a in r.accepted_per_step]
    same = compare_outputs(reference, [r.tokens for r in results])
    return {
        "acceptance": CHECK_ACCEPTANCE,
        "chain": CHECK_CHAIN,
        **same,
        "tau": metrics.tau(accepted) if accepted else None,
        "expected_tau": expected_tau(CHECK_ACCEPTANCE, CHECK_CHAIN),
        "diverged_prompts": oracle.diverged,
    }


def _settle_references(
    spec: SpeculativeDecoder,
    oracle: OracleProposer,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: tuple[int, ...],
) -> int:
    """Rehearse the oracle untimed (this is also its warm-up) until every output follows its
    reference: where the loop's greedy tokens differ from plain decoding's (bf16 near-ties), they
    become the reference, so the oracle's right guesses are right for the loop that verifies them.
    Returns the passes run."""
    for rehearsal in range(1, REHEARSALS + 1):
        changed = False
        for prompt in prompts:
            out = spec.generate(prompt, max_new_tokens, eos_ids=eos_ids).tokens
            ref = oracle.references[tuple(prompt)].tolist()
            if ref[: len(out)] != out:
                oracle.set_reference(prompt, out + ref[len(out) :])
                changed = True
        if not changed:
            return rehearsal
    return REHEARSALS


def markdown_section(result: dict[str, Any]) -> str:
    """The proposers side by side: the served drafter's row (when the bench ran one) above the
    oracle's."""
    o = result.get("oracle")
    if not o:
        return ""
    out = (
        "\n| proposer | chain | acceptance (first position) | draft ms a call | expected tau | tau "
        "| speculative / runtime AR | lossless |\n|---|---|---|---|---|---|---|---|\n"
    )
    if "speedup" in result:  # a drafter ran: its row first
        by_position = result.get("acceptance_by_position") or []
        first = f"{by_position[0]:.2f}" if by_position else "n/a"
        out += (
            f"| {result['method']} (served) | {len(by_position) or 'plain'} | {first} | measured |"
            f" n/a | {result['tau']:.2f} | {result['speedup']['vs_runtime_ar']:.2f} |"
            f" {result.get('lossless')} |\n"
        )
    lo, hi = o["speedup_vs_ar_ci95"]
    interval = "" if lo is None else f" [{lo:.2f}, {hi:.2f}]"
    detail = o["lossless_detail"]
    measured = o["acceptance_by_position"][0] if o["acceptance_by_position"] else None
    first = f"{o['acceptance']:.2f}" + ("" if measured is None else f" (measured {measured:.2f})")
    out += (
        f"| oracle (seed {o['seed']}) | {o['chain']} | {first} | {o['draft_ms']:g} "
        f"| {o['expected_tau']:.2f} | {o['tau']:.2f} | {o['speedup_vs_ar']:.2f}{interval} "
        f"| {o['lossless']} ({detail['identical']}/{detail['total']}, {detail['dtype']}) |\n"
    )
    if o.get("diverged_prompts"):
        out += (
            f"\nThe oracle left its reference on {o['diverged_prompts']} prompt(s) in the timed"
            f" pass (a {detail['dtype']} near-tie flipped after rehearsal): its tau there"
            " understates the ceiling.\n"
        )
    return out


def bench_oracle_alone(args: argparse.Namespace, request: OracleRequest) -> int:
    """``bench --oracle-acceptance P`` without ``--drafter``: the oracle on the target alone
    (printed; bench.json and bench.md in ``--out``)."""
    from draftsmith.bench.prompts import load_prompts
    from draftsmith.runtime.decoding.prompt_limits import context_limit
    from draftsmith.runtime.serving import load_runtime

    rt = load_runtime(
        None,
        args.target,
        args.dtype,
        args.kernels,
        linear_backend=args.linear_backend,
        backend=args.backend,
    )
    prompts = load_prompts(
        args.prompts, rt.tokenizer, args.num_prompts, max_len=context_limit(rt.model)
    )
    backend = rt.backend_report()
    result = {
        "method": "oracle",
        "target": rt.folder,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "dtype": backend["dtype"],
        "threads": torch.get_num_threads(),
        "backend": backend,
        "oracle": run_oracle(
            rt.model, rt.eos_ids, prompts, args.max_new_tokens, request, args.kernels
        ),
    }
    table = _alone_table(result)
    print(table)
    if args.out:
        from draftsmith.common.atomic_folder import write_file

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_file(
            out / "bench.json", json.dumps(result, indent=2) + "\n"
        )  # beside, then renamed in
        write_file(out / "bench.md", table)
        print(f"wrote {out / 'bench.json'}, bench.md")
    return 0


def _alone_table(result: dict[str, Any]) -> str:
    """The oracle-only bench's markdown: what ran, then the oracle's row."""
    b = result["backend"]
    rows = [
        ("target", result["target"]),
        ("CPU", b.get("cpu", "n/a")),
        ("prompts x max new tokens", f"{result['prompts']} x {result['max_new_tokens']}"),
        (
            "dtype / linears / threads",
            f"{result['dtype']} / {b.get('linear_backend')} / {result['threads']}",
        ),
        ("runtime AR tokens/s", f"{result['oracle']['tokens_per_s']['runtime_ar']:.1f}"),
        ("oracle tokens/s", f"{result['oracle']['tokens_per_s']['speculative']:.1f}"),
    ]
    return (
        "| metric | value |\n|---|---|\n"
        + "".join(f"| {k} | {v} |\n" for k, v in rows)
        + markdown_section(result)
    )
