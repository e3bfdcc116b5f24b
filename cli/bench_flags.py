"""The flags of each ``draftsmith bench`` mode (:mod:`draftsmith.cli.bench_modes` registers them):
``export``'s timing, output-length and engine-parity flags, ``controller``'s, ``reward``'s and
``diffusion``'s; ``--prompts``/``--num-prompts``/``--out`` are common to all."""

from __future__ import annotations

import argparse

from draftsmith.cli.arguments import COUNT, SEED, TEMPERATURE, Range, counts, number_list
from draftsmith.cli.oracle_flags import add_oracle_arguments
from draftsmith.cli.serving import add_serving_flags, add_target_flags
from draftsmith.cli.serving import add_verifier_flag as _add_verifier


def _prompts_and_out(b: argparse.ArgumentParser, prompts: str = "mtbench", also: str = "") -> None:
    """``--prompts`` (default ``prompts``; ``also``: more forms this mode takes), ``--num-prompts``
    and ``--out``."""
    b.add_argument(
        "--prompts",
        default=prompts,
        help=(
            "mtbench, humaneval or a .jsonl with 'prompt' (or 'turns'); NAME[a:b] takes a"
            f" slice{also}"
        ),
    )
    b.add_argument(
        "--num-prompts",
        type=counts("leave it out to use every prompt"),
        default=None,
        help="use the first N prompts",
    )
    b.add_argument(
        "--out", default=None, help="folder for the results (checked before the bench runs)"
    )


def export_arguments(b: argparse.ArgumentParser) -> None:
    """``bench export``: the drafter, prompts and output, what is timed, how long the outputs run,
    the engines beside it, the oracle and the serving flags."""
    b.add_argument("--drafter", default=None, help="export folder of a trained drafter")
    _prompts_and_out(b)
    b.add_argument("--seed", type=SEED, default=0)
    _timing_flags(b)
    _output_length_flags(b)
    _engine_parity_flags(b)
    add_oracle_arguments(b)
    add_serving_flags(b)
    b.set_defaults(max_new_tokens=None)  # 128, or --long's 2048 (bench.windows.apply_preset)


def _timing_flags(b: argparse.ArgumentParser) -> None:
    """What ``bench export`` times beside the policy in force (HF generate, fixed depths,
    llama.cpp), and in which dtypes."""
    b.add_argument("--skip-hf", action="store_true", help="do not time HF generate")
    b.add_argument(
        "--profile",
        action="store_true",
        help=(
            "time each part of a speculative step (drafting, verify forward, verification, KV,"
            " update)"
        ),
    )
    b.add_argument(
        "--sweep-k",
        default=None,
        type=number_list(Range(int, low=0), "draft depths"),
        metavar="K1,K2,...",
        help="also time fixed draft depths K on the same prompts, next to the policy in force",
    )
    b.add_argument(
        "--hf-dtype",
        default="auto",
        choices=["auto", "same", "fp32", "bf16"],
        help=(
            "dtype HF generate is timed in: auto (its fastest here: bf16 where native, else fp32) |"
            " same (the runtime's) | fp32 | bf16"
        ),
    )
    b.add_argument(
        "--lossless-dtype",
        default="fp32",
        choices=["fp32", "bf16", "same", "none"],
        help=(
            "dtype of the lossless check (greedy spec vs HF generate); 'same' = the timing dtype, "
            "'none' = skip"
        ),
    )

    b.add_argument(
        "--llamacpp",
        action="store_true",
        help=(
            "also time llama.cpp greedy on the same prompts and threads (`make llamacpp` builds it"
            " once): the shipped Q4_1 GGUF and a BF16 GGUF converted from the target"
            " (peers.llamacpp)"
        ),
    )


def _output_length_flags(b: argparse.ArgumentParser) -> None:
    """How long ``bench export``'s outputs run and how tau by output window cuts them."""
    b.add_argument(
        "--window",
        type=COUNT,
        default=None,
        metavar="TOKENS",
        help=(
            "output tokens per window of tau by output window (bench.json tau_by_window; default"
            " 256)"
        ),
    )
    b.add_argument(
        "--long",
        action="store_true",
        help=(
            "long outputs, so acceptance decay shows: 2 prompts x 2048 "
            "new tokens, window 256 (each where not given); generation still stops at EOS"
        ),
    )


def _engine_parity_flags(b: argparse.ArgumentParser) -> None:
    """Engine parity: the export's tau in each engine in reach that runs its method."""
    b.add_argument(
        "--engine-parity",
        action="store_true",
        help=(
            "also run the export in each engine in reach that runs its method (llama.cpp: EAGLE-3,"
            " DFlash) on the same prompts and drafted chain: tau ours vs tau in the engine; a gap"
            " over 5%% is a defect of the export (bench.json engine_parity)"
        ),
    )
    b.add_argument(
        "--parity-chain",
        type=COUNT,
        default=None,
        help=(
            "with --engine-parity: tokens drafted per step in both engines (default: 4; DFlash: "
            "block_size - 1)"
        ),
    )


def controller_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument(
        "--controller",
        required=True,
        help="adaptive-temperature export: tokens/s with and without it",
    )
    b.add_argument(
        "--drafter",
        default=None,
        help="with a drafter: speculative sampling against the tempered target",
    )
    _prompts_and_out(b)
    add_serving_flags(b)


def reward_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument(
        "--controller",
        default=None,
        help=(
            "adaptive-temperature export(s), comma-separated (none: fixed temperatures only): the"
            " mean reward of each layer and of every fixed temperature of its grid, per prompt"
            " kind, with 95%% intervals, and each layer's overhead in tokens/s"
        ),
    )
    _prompts_and_out(
        b,
        "embedded:heldout",
        "; also embedded[:train|heldout|all] (the mixed reward task) or a .jsonl "
        "of {text, kind?, answer?}",
    )
    b.add_argument(
        "--reward",
        default=None,
        help=(
            "score rewards with this reward (embedded, exact_match, open_ended "
            "or pkg.module:function; default embedded on the embedded task)"
        ),
    )
    b.add_argument(
        "--samples-per-prompt", type=COUNT, default=4, help="responses sampled per prompt"
    )
    b.add_argument(
        "--grid",
        default=None,
        type=number_list(TEMPERATURE, "temperatures"),
        help="the fixed temperatures compared (default: the controllers' grid, else 0,0.2,...,1)",
    )
    b.add_argument(
        "--overhead-prompts", type=COUNT, default=8, help="prompts timed for the overhead"
    )
    b.add_argument("--seed", type=SEED, default=0)
    add_target_flags(b)
    _add_verifier(b)


def diffusion_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument(
        "--target",
        required=True,
        help=(
            "block-diffusion target (recipe=diffusion_adapt's <run dir>/export "
            "or `draftsmith diffusion-export`'s folder)"
        ),
    )
    b.add_argument(
        "--filter", default=None, help="Learn2PD export: bench baseline, Learn2PD, EoTP and both"
    )
    _prompts_and_out(b)
    b.add_argument(
        "--cache",
        default="off",
        choices=["off", "on", "both"],
        help="prefix KV cache across finished blocks off, on, or every mode both ways",
    )
    b.add_argument("--gen-length", type=COUNT, default=256, help="answer slots per prompt")
    b.add_argument(
        "--steps-per-block",
        type=counts("leave it out for one step per block position"),
        default=None,
        help="denoising steps per block (default: the block length)",
    )
    b.add_argument(
        "--threshold",
        default=None,
        type=Range(
            float,
            low=0,
            high=1,
            low_open=True,
            high_open=True,
            hint=(
                "the Learn2PD filter's acceptance threshold: needs --filter EXPORT and a value"
                " strictly between 0 and 1"
            ),
        ),
        help="the Learn2PD filter's acceptance threshold (default: the exported one)",
    )
    b.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow a target whose modelling code ships with it (LLaDA, Dream)",
    )
    b.add_argument("--temperature", type=TEMPERATURE, default=0.0)
    b.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16", "auto"],
        help="fp32 (auto means fp32) | bf16",
    )
