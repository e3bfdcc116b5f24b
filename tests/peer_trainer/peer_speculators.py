"""The peer trainer at equal budget: speculators' own EAGLE-3 trainer (``speculators.train``, 0.9.0)
on our conversations and our target's hidden states, its checkpoint imported with ``draftsmith
import``.

    .venv/bin/python tests/peer_trainer/peer_speculators.py --target smollm2-135m --data sharegpt \\
        --tokens 200000 --out DIR

A test harness (``tests/test_peer_speculators.py`` runs it on a tiny target, the GPU training
check times its trainer). Three stages, each into ``--out`` (a re-run with the same plan keeps the
finished ones: the data when ``peer.json`` records the same tokens, the training when it records
its seconds), and a fourth with ``--evaluate``:

1. ``data/``: conversations taken in order until ``--tokens`` tokens, written with the target's
   hidden states in speculators' data format (:mod:`speculators_data`), here: our venv, our
   Target.
2. ``speculators/``: ``python -m speculators.train`` run in ``.cache/venv-speculators`` through a
   wrapper that patches it for the CPU (:mod:`speculators_trainer`), one epoch per ``--epochs``
   over those tokens.
3. ``export/``: the last epoch's checkpoint imported (``export/speculators_import.py``) against
   ``--target``.

4. ``--evaluate``: the export's held-out acceptance, evaluated as a ``draftsmith curve`` point, and
   with ``--compare-curve DIR`` that curve's acceptance at the same training tokens beside it
   (``peer.json`` ``eval``).

``peer.json`` records the sizes, the trainer command line and the seconds of each stage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # the stages beside this file, when it is loaded by path
    sys.path.append(_HERE)

from speculators_data import tokenized_samples, write_peer_data  # noqa: E402
from speculators_trainer import (  # noqa: E402
    SPEC_PYTHON,
    last_checkpoint,
    run_trainer,
    trainer_flags,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target folder or alias (smollm2-135m)")
    p.add_argument(
        "--data", default="sharegpt", help="conversations: sharegpt, a .jsonl/.json/.parquet file"
    )
    p.add_argument(
        "--tokens",
        type=int,
        required=True,
        help="training tokens per epoch (conversations in order)",
    )
    p.add_argument(
        "--out", required=True, type=Path, help="folder for data/, speculators/, export/, peer.json"
    )
    p.add_argument(
        "--taps", type=int, nargs=3, default=None, help="hidden_states taps (default: EAGLE-3's)"
    )
    p.add_argument("--max-length", type=int, default=2048, help="tokens per conversation at most")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--draft-vocab-size", type=int, default=0, help="0: the full vocabulary")
    p.add_argument("--hs-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculators-python", type=Path, default=SPEC_PYTHON)
    p.add_argument("--timeout", type=float, default=6 * 3600.0, help="seconds the trainer may run")
    p.add_argument(
        "--trainer-arg",
        action="append",
        default=[],
        help="one more speculators.train token (repeat)",
    )
    p.add_argument(
        "--evaluate",
        action="store_true",
        help=(
            "4. held-out acceptance of the imported export, as a `draftsmith curve` point (8 x 128 "
            "MT-Bench and HumanEval, greedy, the runtime's loop)"
        ),
    )
    p.add_argument(
        "--compare-curve",
        type=Path,
        default=None,
        metavar="CURVE_DIR",
        help=(
            "with --evaluate: the curve's acceptance at the peer's training tokens beside the"
            " peer's"
        ),
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the three stages (module docstring); returns (and writes) ``peer.json``."""
    from draftsmith import assets
    from draftsmith.cli.importing import target_facts
    from draftsmith.distill.data.conversations import load_conversations
    from draftsmith.distill.target.frozen import Target
    from draftsmith.drafters.eagle3 import default_target_layers
    from draftsmith.export.speculators_import import import_speculators

    args = parse_args(argv)
    if not args.speculators_python.is_file():
        raise SystemExit(
            f"no speculators venv python at {args.speculators_python} (make speculators-venv)"
        )
    folder = str(Path(assets.resolve_target(args.target)).resolve())
    target = Target.load(folder, dtype="fp32")
    taps = tuple(args.taps or default_target_layers(target.num_layers))
    start = time.perf_counter()
    conversations, _ = load_conversations(args.data)
    samples = tokenized_samples(target.tokenizer, conversations, args.tokens, args.max_length)
    report = data_stage(args, target, folder, taps, samples, start)
    data_dir, save_dir = args.out / "data", args.out / "speculators"
    flags = trainer_flags(
        folder, data_dir, save_dir, taps, args, max(len(s["input_ids"]) for s in samples)
    )
    report["trainer_command"] = ["python", "-m", "speculators.train", *flags]
    if "train" not in report["seconds"]:
        train_stage(args, report, flags)
    checkpoint = last_checkpoint(save_dir)
    identity, embed = target_facts(folder)
    report["checkpoint"] = str(checkpoint)
    report["export"] = str(import_speculators(checkpoint, args.out / "export", identity, embed))
    write_report(args.out, report)
    if args.evaluate:
        report["eval"] = evaluate_peer(
            report["export"], report["data"]["tokens"], args.compare_curve
        )
        write_report(args.out, report)
    return report


def data_stage(
    args: argparse.Namespace,
    target: object,
    folder: str,
    taps: tuple[int, ...],
    samples: list[dict],
    start: float,
) -> dict:
    """Stage 1: the data written (or kept: a re-run keeps the finished stages of the same plan);
    returns the report so far."""
    kept = kept_report(args.out, samples)
    if kept.get("data"):
        return kept
    sizes = write_peer_data(target, samples, taps, args.out / "data", getattr(torch, args.hs_dtype))
    report = {
        "target": folder,
        "taps": list(taps),
        "data": sizes,
        "seconds": {"data": time.perf_counter() - start},
    }
    write_report(args.out, report)
    return report


def train_stage(args: argparse.Namespace, report: dict, flags: list[str]) -> None:
    """Stage 2: speculators' trainer from scratch (a killed trainer's partial epochs cannot be
    resumed, so they are removed), its seconds recorded."""
    save_dir = args.out / "speculators"
    shutil.rmtree(save_dir, ignore_errors=True)
    save_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    run_trainer(
        args.out / "data",
        flags,
        args.speculators_python,
        args.timeout,
        args.out / "speculators.log",
    )
    report["seconds"]["train"] = time.perf_counter() - start
    write_report(args.out, report)


def kept_report(out: Path, samples: list[dict]) -> dict:
    """``peer.json`` of an earlier run whose data stage wrote exactly these samples (else empty:
    start over)."""
    path = out / "peer.json"
    if not path.is_file() or not (out / "data" / "samples.jsonl").is_file():
        return {}
    report = json.loads(path.read_text())
    same = report.get("data", {}).get("tokens") == sum(len(s["input_ids"]) for s in samples)
    return report if same else {}


def write_report(out: Path, report: dict) -> None:
    """``peer.json``, atomically (a killed stage leaves the previous stage's record)."""
    tmp = out / f".peer.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out / "peer.json")


def evaluate_peer(export: str, tokens: int, curve_dir: Path | None) -> dict:
    """The imported export evaluated as a curve point
    (:func:`draftsmith.evals.learning_curve.evaluate_export`), and, with ``curve_dir``, that curve's
    first-position acceptance at the same training tokens (log-interpolated between its points; None
    where the curve does not reach them)."""
    from draftsmith.evals.curve_pick import interpolate
    from draftsmith.evals.learning_curve import EvalSettings, evaluate_export

    settings = EvalSettings()
    record, _ = evaluate_export(export, settings)
    sets = settings.prompt_sets
    out = {
        "tokens": tokens,
        "first_position": {s: record[s]["first_position_acceptance"] for s in sets},
        "conditional": {s: record[s]["conditional_acceptance"] for s in sets},
        "record": record,
    }
    if curve_dir is not None:
        curve = json.loads((curve_dir / "curve.json").read_text())
        points = [p for p in curve["points"] if p.get("tokens")]
        out["curve"] = {
            "dir": str(curve_dir),
            "first_position_at_equal_tokens": {
                s: interpolate(
                    [p["tokens"] for p in points],
                    [p["eval"][s]["first_position_acceptance"] for p in points],
                    tokens,
                )
                for s in sets
            },
        }
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=2))
