"""``draftsmith rollouts``: preference pairs for adaptive-temperature (LPO) training, from the
decoder's own samples.

Per prompt: sample N responses in one batch with the current adaptive decoder (``--controller
EXPORT``: the head SAMPLES a temperature index from its softmax, per response or per token, because
LPO learns from the decoder's own random choices) or, in the first round, with uniformly random grid
temperatures; record the temperature index of every generated token; score each response with the
reward; the best is ``chosen`` and the worst ``rejected`` (a prompt whose N rewards all tie gives no
pair and is counted).

Output folder: ``meta.json`` (settings, written first) and ``rollouts.jsonl``, one line per prompt:
``{"prompt_index", "id", "kind", "text", "answer", "prompt_ids", "samples": [{"tokens", "temps",
"reward", "response"}], "chosen", "rejected"}`` where ``temps[t]`` is the grid index that sampled
``tokens[t]``. Lines are appended and flushed one prompt at a time; a rerun with the same settings
drops a torn last line, skips the prompts already written and continues, and each prompt's sampling
generator is seeded from (seed, prompt index), so a resumed folder holds the same rows as an
uninterrupted run. Other settings in the same folder are refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from draftsmith.common.errors import DraftsmithError
from draftsmith.common.hf_forward import backbone, hf_forward
from draftsmith.controllers.adaptive_temperature import (
    DEFAULT_GRID,
    AdaptiveTemperatureHead,
    check_granularity,
    check_grid,
)
from draftsmith.datagen.rewards import Reward, load_reward, score
from draftsmith.datagen.rollout_folder import META, ROWS  # the format this writes
from draftsmith.runtime.acceptance.verifiers import target_probs

# conf/data/sharegpt.yaml's data.max_length, what `train.py recipe=adaptive_temperature
# data=<rollouts>` cuts rows at unless told otherwise (datagen/ reads no Hydra config;
# tests/test_training_refusals.py keeps the two equal).
DEFAULT_TRAIN_MAX_LENGTH = 256


def length_warning(
    prompt_lengths: Sequence[int],
    max_new_tokens: int,
    train_max_length: int = DEFAULT_TRAIN_MAX_LENGTH,
) -> str | None:
    """The warning to print before sampling when prompts will not fit training's default
    ``data.max_length``: prompts that leave no response token are skipped by training, longer
    responses are cut; None when all fit.
    """
    if not prompt_lengths:
        return None
    longest = max(prompt_lengths)
    too_long = sum(n >= train_max_length for n in prompt_lengths)
    cut = sum(n < train_max_length < n + max_new_tokens for n in prompt_lengths)
    if not too_long and not cut:
        return None
    parts = []
    if too_long:
        parts.append(
            f"{too_long} of {len(prompt_lengths)} prompt(s) have {train_max_length}+ tokens (the"
            f" longest {longest}) and leave no response token at training's default"
            f" data.max_length={train_max_length}: training skips them"
        )
    if cut:
        parts.append(
            f"{cut} prompt(s) + --max-new-tokens {max_new_tokens} exceed it: their responses"
            " are cut"
        )
    return (
        f"warning: {'; '.join(parts)}. Train with data.max_length={longest + max_new_tokens}, or"
        " use shorter prompts (--limit / --prompts)"
    )


class RolloutError(DraftsmithError, ValueError):
    """A rollout folder cannot be written as asked (one actionable message)."""


@torch.no_grad()
def sample_group(
    model: Any,
    prompt_ids: Sequence[int],
    n: int,
    grid: Sequence[float],
    granularity: str,
    head: AdaptiveTemperatureHead | None = None,
    max_new_tokens: int = 64,
    eos_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    choice: str = "sample",
) -> list[tuple[list[int], list[int]]]:
    """N sampled responses of one prompt with a HF causal LM -> ``[(tokens, temperature indices)]``,
    each cut after its first eos. The head (or a uniform draw when None) picks the index from the
    post-norm hidden state that produces the token's logits: once per response (``sequence``) or at
    every token (``token``); ``choice`` is ``sample`` (a draw from the head: what LPO learns from)
    or ``greedy`` (its argmax: how it is served).
    """
    base = backbone(model)  # the module its forward runs for the hidden states (OPT: the decoder)
    device = next(model.parameters()).device
    temps = torch.tensor(list(grid), dtype=torch.float64)  # [K]
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=device).repeat(
        n, 1
    )  # [P] -> [N, P]
    out, logits = hf_forward(model, base, 1, input_ids=ids, use_cache=True)
    tokens, choices, fixed = [], [], None
    eos, finished = torch.tensor(list(eos_ids), dtype=torch.long), torch.zeros(n, dtype=torch.bool)
    for _ in range(max_new_tokens):
        hidden = out.last_hidden_state[:, -1]  # [N, H] post-norm
        if fixed is None or granularity == "token":
            if (
                head is None and len(temps) == 1
            ):  # a fixed temperature draws nothing: its token draws then match a
                idx = torch.zeros(
                    n, dtype=torch.long
                )  # layer's that picks the same temperature (paired benches)
            elif head is None:
                idx = torch.randint(len(temps), (n,), generator=generator)
            else:
                idx = head.choose(hidden, choice, generator).cpu()  # [N]
            fixed = idx
        probs = target_probs(logits[:, -1].cpu(), temps[fixed])  # [N, V] float64
        tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # [N]
        tokens.append(tok)
        choices.append(fixed)
        finished |= torch.isin(tok, eos)
        if bool(
            finished.all()
        ):  # rows past their eos keep sampling until every row is done; their tail is cut
            break
        out, logits = hf_forward(
            model,
            base,
            1,
            input_ids=tok[:, None].to(device),
            past_key_values=out.past_key_values,
            use_cache=True,
        )
    toks, idxs = torch.stack(tokens, 1).tolist(), torch.stack(choices, 1).tolist()  # [N, L]
    result = []
    for row, rix in zip(toks, idxs):
        end = next((t + 1 for t, tok in enumerate(row) if tok in eos_ids), len(row))
        result.append((row[:end], rix[:end]))
    return result


def settings(
    target: str,
    grid: Sequence[float],
    granularity: str,
    n: int,
    max_new_tokens: int,
    reward: str,
    seed: int,
    prompts: str,
    num_prompts: int,
    controller: str | None,
) -> dict[str, Any]:
    """What identifies a rollout folder (a resumed run must match every field)."""
    return {
        "target": target,
        "grid": list(grid),
        "granularity": granularity,
        "samples_per_prompt": n,
        "max_new_tokens": max_new_tokens,
        "reward": reward,
        "seed": seed,
        "prompts": prompts,
        "num_prompts": num_prompts,
        "controller": controller,
    }


def _done_rows(path: Path) -> list[dict]:
    """Complete rows of a rollouts file; a torn last line (interrupted write) is cut off the
    file."""
    if not path.is_file():
        return []
    raw = path.read_bytes()
    keep = raw[: raw.rfind(b"\n") + 1]
    if len(keep) != len(raw):
        path.write_bytes(keep)
    return [json.loads(line) for line in keep.decode().splitlines() if line.strip()]


def pick_pair(rewards: Sequence[float]) -> tuple[int | None, int | None]:
    """(chosen, rejected) = (first best, last worst) sample, or (None, None) when every reward
    ties."""
    best, worst = max(rewards), min(rewards)
    if best == worst:
        return None, None
    return rewards.index(best), len(rewards) - 1 - list(reversed(rewards)).index(worst)


def write_rollouts(
    model: Any,
    prompts: list[dict],
    out: str | Path,
    reward: Reward,
    decode: Callable[[list[int]], str],
    meta: dict[str, Any],
    head: AdaptiveTemperatureHead | None = None,
    eos_ids: Sequence[int] = (),
    progress: bool = True,
) -> dict[str, Any]:
    """Write (or resume) the rollouts of ``prompts`` (records with ``ids``, ``text``, ``kind``,
    ``answer``) into ``out``; ``meta`` from :func:`settings`. Returns counts."""
    out = Path(out)
    if (out / META).is_file():
        old = json.loads((out / META).read_text())
        if old != meta:
            diff = sorted(k for k in set(meta) | set(old) if old.get(k) != meta.get(k))
            raise RolloutError(
                f"{out} holds rollouts made with other settings ({', '.join(diff)}); use another"
                " --out folder or remove it"
            )
    out.mkdir(parents=True, exist_ok=True)
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    rows = _done_rows(out / ROWS)
    done = {int(r["prompt_index"]) for r in rows}
    bar = _progress(len(prompts), len(done), progress)
    new = 0
    with (out / ROWS).open("a") as handle:
        for i, prompt in enumerate(prompts):
            if i in done:
                continue
            gen = torch.Generator().manual_seed(int(meta["seed"]) * 1_000_003 + i)
            group = sample_group(
                model,
                prompt["ids"],
                int(meta["samples_per_prompt"]),
                meta["grid"],
                meta["granularity"],
                head,
                int(meta["max_new_tokens"]),
                eos_ids,
                gen,
            )
            record = {k: prompt.get(k) for k in ("id", "kind", "text", "answer")}
            samples = []
            for toks, idx in group:
                text = decode(toks)
                samples.append(
                    {
                        "tokens": toks,
                        "temps": idx,
                        "reward": score(reward, record, text, meta["reward"]),
                        "response": text,
                    }
                )
            chosen, rejected = pick_pair([s["reward"] for s in samples])
            line = {
                "prompt_index": i,
                **record,
                "prompt_ids": list(prompt["ids"]),
                "samples": samples,
                "chosen": chosen,
                "rejected": rejected,
            }
            handle.write(json.dumps(line) + "\n")
            handle.flush()
            new += 1
            bar(1)
    rows = _done_rows(out / ROWS)
    pairs = sum(r["chosen"] is not None for r in rows)
    return {
        "prompts": len(prompts),
        "resumed": len(done),
        "written": new,
        "pairs": pairs,
        "ties": len(rows) - pairs,
        "out": str(out),
    }


def _progress(total: int, initial: int, enabled: bool) -> Callable[[int], None]:
    if not enabled:
        return lambda k: None
    try:
        from tqdm import tqdm
    except ImportError:
        state = {"n": initial}

        def plain(k: int) -> None:
            state["n"] += k
            print(
                f"\rrollouts {state['n']}/{total}",
                end="" if state["n"] < total else "\n",
                file=sys.stderr,
            )

        return plain
    bar = tqdm(total=total, initial=initial, desc="rollouts", unit="prompt", file=sys.stderr)
    return bar.update


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``rollouts`` subcommand's flags."""
    p.add_argument(
        "--target",
        default="smollm2-135m",
        help="target folder (default: the embedded smollm2-135m)",
    )
    p.add_argument(
        "--prompts",
        default="embedded",
        help="embedded[:train|heldout|all] or a .jsonl of {text, kind?, answer?}",
    )
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument(
        "--reward",
        default="embedded",
        help=(
            "embedded (exact match where a prompt has an answer, else relevance - repetition),"
            " exact_match, open_ended, or an import path pkg.module:function"
        ),
    )
    p.add_argument(
        "--controller",
        default=None,
        help=(
            "adaptive-temperature export to sample with (default: uniform "
            "random grid temperatures, the first round)"
        ),
    )
    p.add_argument(
        "--grid",
        default=None,
        help="comma-separated temperatures (default 0,0.2,...,1; with --controller: the export's)",
    )
    p.add_argument(
        "--granularity",
        default=None,
        help="sequence | token (default token; with --controller: the export's)",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="fp32", help="fp32 | bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (1 is much faster on a busy machine)",
    )
    p.add_argument("--out", required=True, help="rollout folder (resumes a partial one)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let a target folder that ships its own Python code (config.json auto_map) run it",
    )


def check_arguments(args: argparse.Namespace) -> tuple[tuple[float, ...], str]:
    """Refuse out-of-range flags in one line naming the flag (before the target loads); returns the
    checked grid and granularity."""
    for flag, value, low in (
        ("--limit", args.limit, 1),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--threads", args.threads, 1),
        ("--seed", args.seed, 0),
        ("--samples-per-prompt", args.samples_per_prompt, 2),
    ):
        if value is not None and value < low:
            why = " to form a chosen/rejected pair" if flag == "--samples-per-prompt" else ""
            raise RolloutError(f"{flag} must be >= {low}{why}, got {value}")
    if args.dtype not in ("fp32", "bf16"):
        raise RolloutError(f"--dtype {args.dtype!r}: rollouts run fp32 or bf16")
    try:
        grid = check_grid(
            [t for t in args.grid.split(",") if t.strip()]
            if args.grid is not None
            else DEFAULT_GRID
        )
    except ValueError as err:
        raise RolloutError(f"--grid {args.grid}: {err}") from None
    try:
        return grid, check_granularity(args.granularity or "token")
    except ValueError as err:
        raise RolloutError(f"--granularity {args.granularity}: {err}") from None


def cmd_rollouts(args: argparse.Namespace) -> int:
    """Run ``draftsmith rollouts`` and print its summary as JSON."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith import assets
    from draftsmith.common.chat import encode_chat
    from draftsmith.common.remote_code import refuse_remote_code
    from draftsmith.datagen.mixed_task import load_prompt_records

    grid, granularity = check_arguments(args)
    head = None
    if args.controller:
        head, _ = AdaptiveTemperatureHead.from_export(args.controller)
        for flag, mine, theirs in (
            ("--grid", grid, tuple(head.config.grid)),
            ("--granularity", granularity, head.config.granularity),
        ):
            given = args.grid if flag == "--grid" else args.granularity
            if given is not None and mine != theirs:
                raise RolloutError(
                    f"{flag} {given} differs from the controller's {theirs}; drop the flag"
                )
        grid, granularity = tuple(head.config.grid), head.config.granularity
    reward = load_reward(args.reward)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = assets.resolve_target(args.target)
    trust = bool(getattr(args, "trust_remote_code", False))
    refuse_remote_code(path, trust)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust).eval()
    if head is not None and head.config.hidden_size != model.config.hidden_size:
        raise RolloutError(
            f"the controller reads hidden size {head.config.hidden_size} but the target has "
            f"{model.config.hidden_size}; use the target it was trained on"
        )
    records = load_prompt_records(args.prompts, args.limit)
    for r in records:
        r["ids"] = encode_chat(tokenizer, r["text"])
    if (
        warning := length_warning([len(r["ids"]) for r in records], args.max_new_tokens)
    ) is not None:
        print(
            warning, file=sys.stderr, flush=True
        )  # before the long part, not at training's step 0
    eos = eos_ids_of(tokenizer, model)
    meta = settings(
        args.target,
        grid,
        granularity,
        args.samples_per_prompt,
        args.max_new_tokens,
        args.reward,
        args.seed,
        args.prompts,
        len(records),
        str(Path(args.controller).resolve()) if args.controller else None,
    )
    summary = write_rollouts(
        model,
        records,
        args.out,
        reward,
        lambda t: tokenizer.decode(t, skip_special_tokens=True),
        meta,
        head,
        eos,
        progress=not args.no_progress,
    )
    print(json.dumps(summary, indent=2))
    return 0


def eos_ids_of(tokenizer: Any, model: Any) -> list[int]:
    """The token ids that end a response: the tokenizer's eos and the model's generation-config eos
    (one or a list)."""
    extra = model.generation_config.eos_token_id
    extra = list(extra) if isinstance(extra, list | tuple) else [extra]
    return sorted({i for i in (tokenizer.eos_token_id, *extra) if i is not None})


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m draftsmith.datagen.rollouts ...`` (the same flags as ``draftsmith rollouts``)."""
    parser = argparse.ArgumentParser(prog="draftsmith rollouts", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return cmd_rollouts(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
