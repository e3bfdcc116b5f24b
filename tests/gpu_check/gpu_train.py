"""``make gpu-train``: train EAGLE-3 on a lent GPU with the real target, and measure the trainer
there.

The device tool takes 64 MiB a command (repository included), 10 minutes a command, 15 minutes a
session, and gives back at most 8 files of 16 MiB. The 94 MB target GGUF therefore travels in two
commands:

1. ``prepare`` (here): the GGUF and the tokenised training data (compressed, :mod:`gpu_train_data`)
   split across ``.gpu_train/cmd1`` and ``.gpu_train/cmd2`` (each with the wheels its command needs,
   made by ``make_gpu_train_wheels.sh``), every part with its SHA-256 in the manifest, sized so each
   command fits; prints the two device calls.
2. ``part1`` (first command there): stashes its parts in ``/tmp/gpu-train`` and writes the
   throughput table (ours vs speculators 0.9.0, random weights, real shapes, three batch sizes in
   tokens).
3. ``part2`` (second command, within the 30 s the machine stays warm): assembles and checks the GGUF
   and the data, converts the target, trains EAGLE-3 for the rest of the command, returns the export
   in parts.
4. ``receive`` (here): puts the export back together (sizes and hashes checked; a partial file
   refused in one line) and, with ``--bench``, benches it on this CPU.

``dry-run`` rehearses all four on the CPU with the same code and files (the real GGUF, real data,
tiny steps; ``gpu_train_dry_run.py``), so a lease is spent on the GPU, not on debugging. Stages
are in ``gpu_train_stages.py``; a command re-run after an interruption keeps what is already in
place (parcels and stash are checked, not trusted).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)

import parcels  # noqa: E402
from gpu_check_core import REPO  # noqa: E402
from gpu_train_data import choose_samples, tokenizer_fingerprint  # noqa: E402
from gpu_train_dry_run import dry_run  # noqa: E402
from gpu_train_stages import DATA, GGUF, speed_stage, stash_parts, train_stage  # noqa: E402

COMMAND_BYTES = 64 * 2**20  # what one device command may carry, the repository included
MARGIN = 2 * 2**20
CARRY = ".gpu_train"


def repository_bytes() -> int:
    """Bytes of what travels with every command: tracked files and untracked ones git does not
    ignore."""
    names = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    return sum((REPO / n).stat().st_size for n in names if n and (REPO / n).is_file())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def training_samples(data: str, max_length: int, limit: int | None) -> tuple[list[dict], object]:
    """All tokenised samples of ``data`` at ``max_length`` (draftsmith's chat masking, its sample
    cache) and the converted target's tokenizer."""
    from transformers import AutoTokenizer

    from draftsmith import assets
    from draftsmith.distill.data.datamodule import ChatDataModule

    tokenizer = AutoTokenizer.from_pretrained(str(assets.default_target_dir()))
    module = ChatDataModule(tokenizer, data, max_length=max_length, batch_size=1, limit=limit)
    return module.samples(), tokenizer


def prepare(args: argparse.Namespace) -> dict:
    """The two command folders (module docstring, step 1); returns the plan it printed."""
    from draftsmith import assets

    out = Path(args.out)  # .gpu_train/ is in .gitignore: it travels only as a device call's `carry`
    cmd1, cmd2 = out / "cmd1", out / "cmd2"
    for folder in (cmd1, cmd2):
        for old in folder.glob("*.part*"):
            old.unlink()
    repo = repository_bytes()
    room1 = COMMAND_BYTES - MARGIN - repo - folder_bytes(cmd1 / "wheels")
    room2 = COMMAND_BYTES - MARGIN - repo - folder_bytes(cmd2 / "wheels")
    gguf = Path(args.gguf) if args.gguf else assets.gguf_path()
    size = gguf.stat().st_size
    data_room = room1 + room2 - size
    if data_room < 2**20:
        raise SystemExit(
            f"gpu-train prepare: the GGUF ({size:,} B) leaves {data_room:,} B for data in two"
            " commands"
        )
    samples, tokenizer = training_samples(args.data, args.max_length, args.data_limit)
    meta = {
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_length": args.max_length,
        "source": args.data,
    }
    blob = choose_samples(samples, min(data_room, args.data_mib * 2**20), meta, seed=args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        data_file = Path(tmp) / DATA
        data_file.write_bytes(blob)
        files = {
            GGUF: parcels.split_across(gguf, GGUF, [(cmd1, room1), (cmd2, None)]),
            DATA: parcels.split_across(
                data_file, DATA, [(cmd1, max(0, room1 - size)), (cmd2, None)]
            ),
        }
    for folder in (cmd1, cmd2):
        parcels.write_manifest(folder, files, data=json.loads(json.dumps(meta)))
    _, decoded_meta = _peek(blob)
    plan = {
        "repository_bytes": repo,
        "command_bytes": {"cmd1": repo + folder_bytes(cmd1), "cmd2": repo + folder_bytes(cmd2)},
        "gguf_bytes": size,
        "data_bytes": len(blob),
        "data": decoded_meta,
    }
    print(json.dumps(plan, indent=2))
    print(device_calls(out))
    return plan


def _peek(blob: bytes) -> tuple[list[dict], dict]:
    from gpu_train_data import decode_samples

    samples, meta = decode_samples(blob)
    return samples, {"samples": meta.get("samples"), "tokens": meta.get("tokens")}


def device_calls(out: Path) -> str:
    """What the lead runs: the two device calls and the command that brings the export home."""
    rel = out.resolve().relative_to(REPO) if out.resolve().is_relative_to(REPO) else out
    return "\n".join(
        [
            "device calls (the second within 30 s of the first's end):",
            (
                f'  run(command="bash tests/gpu_check/gpu_train.sh part1", carry=["{rel}/cmd1"],'
                " timeout_s=300)"
            ),
            (
                f'  run(command="bash tests/gpu_check/gpu_train.sh part2", carry=["{rel}/cmd2"],'
                " timeout_s=590)"
            ),
            (
                "then here: python tests/gpu_check/gpu_train.py receive <files_at>/export --out"
                " outputs/gpu_train/export --bench"
            ),
        ]
    )


def part(args: argparse.Namespace) -> dict:
    """``part1`` / ``part2`` on the device (module docstring, steps 2-3)."""
    started = time.monotonic()
    out, stash, parcel = Path(args.out_dir), Path(args.stash), Path(args.parcels)
    out.mkdir(parents=True, exist_ok=True)
    report = {"stash": stash_parts(parcel, stash)}
    if args.command == "part1":
        report["speed"] = speed_stage(args, out, stash)["table"]
    else:
        deadline = started + args.seconds
        report["train"] = train_stage(args, out, stash, parcel, deadline)
    print(json.dumps(report, indent=2, default=str))
    return report


def receive(args: argparse.Namespace) -> Path:
    """Step 4: the export put back together here (checked), and benched on this CPU with
    ``--bench``."""
    dest = parcels.unpack_folder(Path(args.parcel), Path(args.out))
    print(f"gpu-train: export reassembled and checked at {dest}")
    if args.bench:
        bench = [
            sys.executable,
            "-m",
            "draftsmith.cli",
            "bench",
            "export",
            "--drafter",
            str(dest),
            "--prompts",
            "mtbench",
            "--num-prompts",
            str(args.bench_prompts),
            "--max-new-tokens",
            str(args.bench_tokens),
            "--out",
            str(dest.parent / f"{dest.name}-bench"),
            *(["--skip-hf"] if args.bench_prompts < 4 else []),
        ]
        subprocess.run(bench, check=True, cwd=REPO)
    return dest


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="here: the two command folders")
    prep.add_argument("--out", default=str(REPO / CARRY))
    prep.add_argument("--gguf", default=None, help="default: the embedded target's GGUF")
    prep.add_argument("--data", default="sharegpt")
    prep.add_argument("--data-limit", type=int, default=None)
    prep.add_argument(
        "--data-mib", type=float, default=64.0, help="data at most this many MiB (compressed)"
    )
    prep.add_argument("--max-length", type=int, default=2048)
    prep.add_argument("--seed", type=int, default=0)
    for name in ("part1", "part2"):
        q = sub.add_parser(name, help=f"there: command {name[-1]}")
        q.add_argument("--parcels", default=str(REPO / CARRY / f"cmd{name[-1]}"))
        q.add_argument("--stash", default="/tmp/gpu-train")
        q.add_argument(
            "--out-dir", default=os.environ.get("OUT", str(REPO / "outputs" / "gpu_train" / name))
        )
        q.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
        q.add_argument("--tiny", action="store_true", help="the CPU rehearsal's sizes")
        q.add_argument("--max-length", type=int, default=2048)
        q.add_argument(
            "--budgets",
            default="16384,65536,131072",
            help="tokens per step of the throughput table",
        )
        q.add_argument("--steps", type=int, default=5)
        q.add_argument("--warmup", type=int, default=3)
        q.add_argument("--skip-peer", action="store_true")
        q.add_argument("--peer-timeout", type=float, default=240.0)
        q.add_argument("--tokens-per-step", type=int, default=65536)
        q.add_argument(
            "--seconds", type=float, default=560.0, help="part2: the command's time, all included"
        )
        q.add_argument("--export-margin", type=float, default=45.0)
        q.add_argument(
            "--assumed-rate",
            type=float,
            default=100000.0,
            help="tokens/s when part1 left no speed.json",
        )
        q.add_argument("--min-steps", type=int, default=20)
        q.add_argument(
            "--max-steps", type=int, default=0, help="part2: at most this many steps (0: what fits)"
        )
    rec = sub.add_parser("receive", help="here: the export back together")
    rec.add_argument("parcel")
    rec.add_argument("--out", default=str(REPO / "outputs" / "gpu_train" / "export"))
    rec.add_argument("--bench", action="store_true")
    rec.add_argument("--bench-prompts", type=int, default=8)
    rec.add_argument("--bench-tokens", type=int, default=128)
    dry = sub.add_parser("dry-run", help="every step on the CPU, tiny")
    dry.add_argument("--work", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "prepare":
            prepare(args)
        elif args.command in ("part1", "part2"):
            part(args)
        elif args.command == "receive":
            receive(args)
        else:
            dry_run(args)
    except parcels.ParcelError as err:
        print(f"gpu-train: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
