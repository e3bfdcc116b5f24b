"""``draftsmith trajectories``: Learn2PD oracle trajectories ("extremely greedy parallel" decoding)
as training data.

Per prompt: decode once with the baseline (greedy) for the reference answer, then again with the
oracle, which at every step records the block's ``L`` confidences and which predictions already
equal the reference (all slots, masked or not), commits every masked slot whose prediction equals
the reference, and copies the reference block in when the predictions did not change since the
previous step (anti-stall). Each step is one example.

Output folder: ``meta.json`` (settings + target identity, written first) and
``shard-NNNNN.safetensors`` files (``conf`` float32 [N, L], ``labels`` uint8 [N, L], ``prompt``
int32 [N], ``step`` int32 [N]), each covering ``shard_size`` prompts and written atomically (temp
file + rename). A rerun with the same settings skips the shards already written (resumable); other
settings in the same folder are refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.common.errors import DraftsmithError
from draftsmith.datagen.resumable_folder import start_folder
from draftsmith.datagen.trajectory_folder import META, SHARD  # the format this writes
from draftsmith.runtime.decoding.diffusion import (
    DiffusionDecodeConfig,
    check_fits,
    diffusion_decode,
)
from draftsmith.runtime.target.diffusion_lm import DiffusionLM


class TrajectoryError(DraftsmithError, ValueError):
    """A trajectory folder cannot be written or read as asked (one actionable message)."""


@dataclass
class OracleTrace:
    """The examples of one prompt: confidences and labels [S, L], the step within its block [S]."""

    conf: torch.Tensor
    labels: torch.Tensor
    steps: torch.Tensor
    reference: list[int]


def oracle_trace(
    lm: DiffusionLM,
    prompt: list[int],
    cfg: DiffusionDecodeConfig,
    reference: list[int] | None = None,
) -> OracleTrace:
    """Reference decode (unless given) then the oracle decode of ``prompt``; the recorded steps."""
    base = DiffusionDecodeConfig(**{**asdict(cfg), "temperature": 0.0, "eotp": False})
    if reference is None:
        reference = diffusion_decode(lm, prompt, base).tokens
    L = lm.spec.block_length
    ref = torch.tensor(reference, dtype=torch.long, device=lm.device)
    confs, labels, steps, state = [], [], [], {"block": 0, "prev": None}

    def observe(
        b: int,
        step: int,
        masked: torch.Tensor,
        x0: torch.Tensor,
        conf: torch.Tensor,
        canvas: torch.Tensor,
    ) -> None:
        block_ref = ref[b * L : (b + 1) * L]
        confs.append(conf.float().cpu())
        labels.append((x0 == block_ref).cpu())
        steps.append(step)
        if step > 0 and state["prev"] is not None and torch.equal(x0, state["prev"]):
            canvas[masked] = block_ref[
                masked
            ]  # anti-stall: nothing moved, take the reference block
        state["block"], state["prev"] = b, x0.clone()

    def policy(
        step: int, masked: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor, k: int
    ) -> torch.Tensor:
        b = state["block"]
        return masked & (x0 == ref[b * L : (b + 1) * L])

    oracle_cfg = DiffusionDecodeConfig(**{**asdict(base), "gen_length": len(reference)})
    diffusion_decode(lm, prompt, oracle_cfg, policy=policy, observe=observe)
    return OracleTrace(
        torch.stack(confs),
        torch.stack(labels).to(torch.uint8),
        torch.tensor(steps, dtype=torch.int32),
        reference,
    )


def settings(
    lm: DiffusionLM, cfg: DiffusionDecodeConfig, num_prompts: int, shard_size: int
) -> dict[str, Any]:
    """What identifies a trajectory folder: the target, the decoding setup and the prompt list."""
    return {
        "target": lm.name_or_path,
        "block_length": lm.spec.block_length,
        "mask_token_id": lm.spec.mask_token_id,
        "steps_per_block": cfg.steps_per_block,
        "gen_length": cfg.gen_length,
        "stop_at_eot": cfg.stop_at_eot,
        "use_cache": cfg.use_cache,
        "num_prompts": num_prompts,
        "shard_size": shard_size,
    }


def _shard_ok(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return {"conf", "labels"} <= set(handle.keys())
    except Exception:  # noqa: BLE001 - any unreadable shard is redone
        return False


def write_trajectories(
    lm: DiffusionLM,
    prompts: list[list[int]],
    out: str | Path,
    cfg: DiffusionDecodeConfig,
    shard_size: int = 8,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write (or resume) the oracle trajectories of ``prompts`` (token ids) into ``out``; returns
    counts."""
    if not prompts:
        raise TrajectoryError("no prompts to decode")
    for i, p in enumerate(prompts):  # every prompt is checked before any shard is written
        try:
            check_fits(len(p), cfg.gen_length, lm.context)
        except ValueError as err:
            raise TrajectoryError(f"prompt {i}: {err}") from None
    out = Path(out)
    start_folder(
        out, META, settings(lm, cfg, len(prompts), shard_size), "trajectories", TrajectoryError
    )
    examples = resumed = 0
    for s, first in enumerate(range(0, len(prompts), shard_size)):
        path = out / SHARD.format(s)
        count = min(shard_size, len(prompts) - first)
        if path.is_file() and _shard_ok(path):
            resumed += count
            if progress:
                progress(count)
            continue
        examples += _write_shard(lm, prompts, cfg, path, first, count, progress)
    total = sum(_count(p) for p in sorted(out.glob("shard-*.safetensors")))
    return {
        "prompts": len(prompts),
        "resumed_prompts": resumed,
        "new_examples": examples,
        "examples": total,
        "out": str(out),
    }


def _write_shard(
    lm: DiffusionLM,
    prompts: list[list[int]],
    cfg: DiffusionDecodeConfig,
    path: Path,
    first: int,
    count: int,
    progress: Callable[[int], None] | None,
) -> int:
    """Decode prompts ``first .. first + count - 1`` with the oracle and write their examples to
    the shard ``path`` atomically (temp file + rename); returns how many examples it holds."""
    from safetensors.torch import save_file

    parts = []
    for i in range(first, first + count):
        trace = oracle_trace(lm, prompts[i], cfg)
        parts.append((trace, i))
        if progress:
            progress(1)
    tensors = {
        "conf": torch.cat([t.conf for t, _ in parts]).contiguous(),  # [N, L]
        "labels": torch.cat([t.labels for t, _ in parts]).contiguous(),  # [N, L]
        "prompt": torch.cat([torch.full((len(t.steps),), i, dtype=torch.int32) for t, i in parts]),
        "step": torch.cat([t.steps for t, _ in parts]),
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"prompts": f"{first}-{first + count - 1}"})
    os.replace(tmp, path)
    return len(tensors["conf"])


def _count(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return int(handle.get_slice("conf").get_shape()[0])


def run_cli(args: Any) -> dict[str, Any]:
    """``draftsmith trajectories``: load the target, encode the prompts, write/resume the folder
    with a progress bar; returns the counts (printed by the CLI)."""
    from tqdm import tqdm

    from draftsmith.common.dtypes import dtype_from_name
    from draftsmith.common.prompt_sets import encode_prompts
    from draftsmith.runtime.target.diffusion_lm import load_diffusion_lm, supports_prefix_cache

    if args.threads:
        torch.set_num_threads(int(args.threads))
    lm = load_diffusion_lm(
        args.target,
        dtype=dtype_from_name(args.dtype),
        trust_remote_code=bool(getattr(args, "trust_remote_code", False)),
    )
    prompts = encode_prompts(args.prompts, lm.tokenizer, args.limit)
    cfg = DiffusionDecodeConfig(
        gen_length=args.gen_length,
        steps_per_block=args.steps_per_block or lm.spec.block_length,
        stop_at_eot=not args.full,
        use_cache=supports_prefix_cache(lm.spec),
    )  # exact (tests) and several times cheaper
    with tqdm(total=len(prompts), desc="trajectories", unit="prompt") as bar:
        result = write_trajectories(
            lm, prompts, args.out, cfg, shard_size=args.shard_size, progress=bar.update
        )
    print(
        f"{result['examples']} examples from {result['prompts']} prompts in {result['out']}",
        flush=True,
    )
    return result
