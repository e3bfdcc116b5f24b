"""``make gpu-train``'s two commands on the lent GPU machine (and their CPU rehearsal, ``--device
cpu --tiny``).

``part1`` (first command): keep the parts of the target's GGUF (and of the data) this command
brought in the stash outside the repository (``/tmp/gpu-train``: it outlives the command, the
machine stays warm 30 s), then the throughput table at the real shapes with random weights
(:mod:`gpu_train_speed`), written to ``$OUT`` and to the stash (``part2`` sizes its run from our
measured rate).

``part2`` (second command, within the warm window): the GGUF and the data put back together from the
stash and this command's parts (hashes checked), the GGUF converted to an HF folder (draftsmith's
own conversion), the data put in the tokenised-sample cache, EAGLE-3 trained through ``train.py``
(packed rows, ``trainer.compile``, bf16) for the time left, and the export written into
``$OUT/export`` as parts under 16 MiB with their manifest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import parcels
from gpu_check_core import REPO, Plan
from gpu_train_data import decode_samples, install_samples

GGUF = "target.gguf"
DATA = "data.npz.xz"
PART_BYTES_BACK = 15 * 2**20  # files coming back: 16 MiB each at most
FILES_BACK = 8


def stash_parts(parcel: Path, stash: Path) -> dict[str, Any]:
    """This command's parts into ``stash/parts`` (checked); the parts the stash now holds."""
    kept = parcels.stash(parcel, stash / "parts")
    return {"stashed": kept, "stash": str(stash / "parts")}


def peer_speed(
    args: Any, target: Path, chats: list, work: Path, out: Path, budgets: list[int], taps: tuple
) -> list[dict[str, Any]]:
    """speculators' rows of the throughput table on the same random target and chats (none with
    ``--skip-peer``); its log in ``out/peer.log``."""
    from gpu_train_peer import peer_python, peer_rows, write_peer_data

    if args.skip_peer:
        return []
    peer_data = work / "peer-data"
    # one epoch must hold every step after speculators' validation split: three times the tokens
    # needed
    write_peer_data(
        target, chats, peer_data, taps, 3 * (args.warmup + args.steps + 2) * max(budgets)
    )
    return peer_rows(
        peer_python(),
        target,
        peer_data,
        budgets,
        work,
        args.warmup,
        args.steps,
        256 if args.tiny else 8192,
        taps,
        args.peer_timeout,
        out / "peer.log",
        cpu=args.tiny,
    )


def speed_stage(args: Any, out: Path, stash: Path) -> dict[str, Any]:
    """The throughput table (module docstring); ``args.tiny`` shrinks it to the CPU rehearsal's
    sizes."""
    from gpu_check_train import build_random_target
    from gpu_train_speed import our_rows, speed_table, synthetic_chats

    plan = Plan.make(args.device, args.tiny)
    work = stash / "speed"
    target = work / "random-target"
    build_random_target(target, plan)
    short, long = (8, 40) if args.tiny else (200, 1800)
    chats = synthetic_chats(64 if args.tiny else 2000, short, long)
    data = work / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    budgets = [int(b) for b in args.budgets.split(",")]
    ours = our_rows(
        target,
        data,
        budgets,
        args.max_length,
        args.device,
        not args.tiny,
        steps=args.steps,
        warmup=args.warmup,
    )
    layers = plan.shape["num_hidden_layers"]
    taps = (1, 2, 3) if args.tiny else (2, layers // 2, layers - 3)
    peer = peer_speed(args, target, chats, work, out, budgets, taps)
    result = {
        "device": args.device,
        "shape": plan.shape,
        "ours": ours,
        "speculators": peer,
        "table": speed_table(ours, peer),
    }
    for folder in (out, stash):
        (folder / "speed.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "speed.md").write_text(result["table"] + "\n")
    return result


def convert_target(gguf: Path, cache: Path) -> Path:
    """The GGUF as draftsmith's converted target folder under ``cache`` (its own conversion, pointed
    at ``gguf``)."""
    from draftsmith import assets

    original = assets.gguf_path
    assets.gguf_path = lambda: gguf
    try:
        return assets.default_target_dir(cache)
    finally:
        assets.gguf_path = original


def training_overrides(
    args: Any, target: Path, data_spec: Path, run_dir: Path, steps: int, seconds: float
) -> list[str]:
    """``train.py``'s overrides for the GPU run (or its tiny CPU rehearsal); ``trainer.max_time``
    stops it cleanly (then it exports) should it run slower than planned."""
    # on the GPU: compiled, and 8,192-row chunks of the fused loss (fewer, larger GEMMs; 256 MiB of
    # logits each)
    trainer = (
        ["trainer=gpu", "trainer.compile=true", "loss.chunk_size=8192"]
        if args.device == "cuda"
        else ["trainer=cpu"]
    )
    left = max(60, int(seconds))
    trainer.append(
        f"trainer.max_time=00:{left // 3600:02d}:{left % 3600 // 60:02d}:{left % 60:02d}"
    )
    return [
        "recipe=eagle3",
        f"target.name_or_path={target}",
        f"data.spec={data_spec}",
        "data.limit=null",
        f"data.max_length={args.max_length}",
        f"data.tokens_per_step={args.tokens_per_step}",
        "data.val_fraction=0.01",
        f"data.num_workers={0 if args.tiny else 4}",
        *trainer,
        f"trainer.max_steps={steps}",
        f"trainer.log_every_n_steps={max(1, min(50, steps // 10))}",
        f"optim.warmup_steps={max(1, steps // 20)}",
        "run.val_every=0",
        "validation.served_tau.every=0",
        f"run.final_eval_batches={1 if args.tiny else 8}",
        "run.checkpoint_every=100000",
        "logger=csv",
        "run.resume=false",
        f"hydra.run.dir={run_dir}",
    ]


def planned_steps(args: Any, stash: Path, seconds: float) -> tuple[int, float]:
    """Steps that fit ``seconds`` at the online rate part1 measured at the closest budget (else
    ``args.assumed_rate``), and the rate used."""
    rate = float(args.assumed_rate)
    speed = stash / "speed.json"
    if speed.is_file():
        rows = [
            r for r in json.loads(speed.read_text()).get("ours", []) if "train_tokens_per_s" in r
        ]
        if rows:
            best = min(rows, key=lambda r: abs(r["budget"] - args.tokens_per_step))
            rate = float(best["train_tokens_per_s"])
    steps = int(
        seconds * rate * 0.85 / args.tokens_per_step
    )  # 15 % for compilation and the first steps
    steps = max(args.min_steps, steps)
    return (min(steps, args.max_steps) if args.max_steps else steps), rate


def train_stage(args: Any, out: Path, stash: Path, parcel: Path, deadline: float) -> dict[str, Any]:
    """Put the target and data together, convert, install, train for the time left, pack the export
    into ``out``."""
    manifest = parcels.read_manifest(parcel)
    folders = [stash / "parts", parcel]
    gguf = parcels.assemble(manifest, GGUF, folders, stash / GGUF)
    blob = parcels.assemble(manifest, DATA, folders, stash / DATA).read_bytes()
    cache = stash / "cache"
    os.environ["DRAFTSMITH_CACHE"] = str(cache)
    target = convert_target(gguf, cache)
    samples, meta = decode_samples(blob)
    spec = stash / "shipped-data.jsonl"  # names the data: its samples come from the cache
    spec.write_text(
        json.dumps(
            {
                "conversations": [
                    {"from": "human", "value": "pre-tokenised"},
                    {"from": "gpt", "value": "in the cache"},
                ]
            }
        )
        + "\n"
    )
    seconds = deadline - time.monotonic() - args.export_margin
    steps, rate = planned_steps(args, stash, seconds)
    run_dir = stash / "run"
    overrides = training_overrides(args, target, spec, run_dir, steps, seconds - 30)
    install_samples(_datamodule(overrides, target), samples, meta)
    start = time.perf_counter()
    with (out / "train.log").open("w") as log:
        proc = subprocess.run(
            [sys.executable, str(REPO / "train.py"), *overrides],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=max(30.0, deadline - time.monotonic() - 20),
            env={**os.environ, "HYDRA_FULL_ERROR": "1"},
            check=False,
        )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (out / "train.log").read_text(errors="replace").splitlines()[-5:]
        raise RuntimeError(f"train.py exit {proc.returncode}: {' | '.join(tail)}")
    summary = _summary_from_log(out / "train.log")
    _keep_tail(out / "train.log", 4 << 20)  # what comes back: under 16 MiB
    parcels.pack_folder(run_dir / "export", out / "export", PART_BYTES_BACK, FILES_BACK - 3)
    record = {
        "data": meta,
        "planned_steps": steps,
        "planned_rate": rate,
        "wall_seconds": round(wall, 1),
        "summary": summary,
        "tokens_per_s_wall": round(summary.get("tokens", 0) / wall, 1),
    }
    (out / "train.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _datamodule(overrides: list[str], target: Path) -> Any:
    from transformers import AutoTokenizer

    from draftsmith.cli.training import compose_config
    from draftsmith.distill.data.datamodule import build_chat_datamodule

    cfg = compose_config([o for o in overrides if not o.startswith("hydra.")])
    return build_chat_datamodule(cfg, AutoTokenizer.from_pretrained(str(target)))


def _summary_from_log(log: Path) -> dict[str, Any]:
    """train.py's JSON summary from its output (the last JSON object that starts with its ``recipe``
    field)."""
    text = log.read_text(errors="replace")
    start = text.rfind('{\n  "recipe"')
    return json.JSONDecoder().raw_decode(text[start:])[0] if start >= 0 else {}


def _keep_tail(path: Path, limit: int) -> None:
    """Cut a log to its last ``limit`` bytes."""
    data = path.read_bytes()
    if len(data) > limit:
        path.write_bytes(b"[... cut ...]\n" + data[-limit:])
