"""The peer trainer at equal budget: speculators' own EAGLE-3 trainer (``speculators.train``, 0.9.0)
on our conversations and our target's hidden states, its checkpoint imported with ``draftsmith
import``.

    .venv/bin/python scripts/peer_speculators.py --target smollm2-135m --data sharegpt \\
        --tokens 200000 --out DIR

Three stages, each into ``--out`` (a re-run with the same plan keeps the finished ones: the data
when ``peer.json`` records the same tokens, the training when it records its seconds), and a fourth
with ``--evaluate``:

1. ``data/``, in speculators' data format, written here (our venv, our Target): ``samples.jsonl``
   (``input_ids``, ``loss_mask``: the assistant tokens, draftsmith's chat tokenisation) turned into
   a ``datasets.save_to_disk`` folder (``input_ids``, ``loss_mask``, ``seq_len``) inside the
   speculators venv (ours has no ``datasets``); ``token_freq.pt`` (token id -> count over the
   loss-masked tokens, for ``--draft-vocab-size``); ``hidden_states/hs_{i}.safetensors`` with
   ``token_ids`` [T] (= ``input_ids``) and ``hidden_states`` [T, 4, H]: the target's
   ``hidden_states[l]`` at the three taps (the input of decoder layer l, draftsmith's and
   speculators' aux-id convention) and the last layer's output BEFORE the final norm (speculators
   applies the verifier's norm and LM head to it for the teacher distribution). Conversations are
   taken in order until ``--tokens`` tokens.
2. ``speculators/``: ``python -m speculators.train``'s ``main`` run in ``.cache/venv-speculators``
   through the wrapper below, on CPU, one epoch per ``--epochs`` over those tokens. Its trainer
   assumes an accelerator; the wrapper patches, in its own process and without touching speculators'
   files: ``trainer.get_local_rank`` -> the CPU device (``Trainer`` moves the model and every batch
   with ``.to(self.local_rank)``; an int means an accelerator), ``Trainer.device_type`` -> ``"cpu"``
   (autocast falls back to ``"cuda"`` without an accelerator), and ``torch.accelerator.synchronize``
   -> a no-op when there is no accelerator (the step timer calls it on logged steps and it raises
   "Cannot access accelerator device when none is available"). Flags: ``--loss-implementation
   eager`` (the fused loss imports triton), ``--draft-attn-impl sdpa`` (flex attention needs a
   compiler backend), ``--on-missing raise`` (the default asks a vLLM server for missing hidden
   states), ``--num-workers 0``; and the draft layer draftsmith's runtime computes:
   ``--no-norm-before-residual --no-norm-before-fc --no-norm-output --full-attention-indices 0``
   (the trainer's eagle3 defaults are the EAGLE 3.1 variant, which ``draftsmith import`` refuses
   with the flag to change). Its provenance patch file is turned off: the venv sits inside
   draftsmith's clone, so speculators would copy the clone's uncommitted diff into the output.
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
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
SPEC_PYTHON = ROOT / ".cache" / "venv-speculators" / "bin" / "python"

# Runs in the speculators venv: argv = [data_dir, *trainer flags]. Builds the dataset folder,
# patches for CPU (module docstring), then calls the trainer's own entry point.
WRAPPER = r"""
import json, sys
from pathlib import Path
import torch
from datasets import Dataset

data = Path(sys.argv[1])
rows = [json.loads(line) for line in (data / "samples.jsonl").read_text().splitlines()]
columns = {"input_ids": [r["input_ids"] for r in rows], "loss_mask": [r["loss_mask"] for r in rows],
           "seq_len": [len(r["input_ids"]) for r in rows]}
Dataset.from_dict(columns).with_format("torch").save_to_disk(str(data))

import speculators.train.trainer as trainer_module
import speculators.train.utils as train_utils
from speculators.train.cli import main
from speculators.train.config import TrainConfig

# The venv sits inside draftsmith's clone: speculators' provenance would take it for its own
# repository and copy the clone's uncommitted diff into the output (speculators.patch). Not its
# repository: no patch file.
train_utils.find_repo_root = lambda start: None

if torch.accelerator.current_accelerator() is None:
    cpu = torch.device("cpu")
    trainer_module.get_local_rank = lambda: cpu
    torch.accelerator.synchronize = lambda *args, **kwargs: None
    original_init = trainer_module.Trainer.__init__

    def cpu_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer_module.Trainer.__init__ = cpu_init
main(TrainConfig.resolve(sys.argv[2:]))
"""
CPU_FLAGS = [
    "--loss-implementation",
    "eager",
    "--draft-attn-impl",
    "sdpa",
    "--on-missing",
    "raise",
    "--num-workers",
    "0",
]
LAYER_FLAGS = [
    "--no-norm-before-residual",
    "--no-norm-before-fc",
    "--no-norm-output",
    "--full-attention-indices",
    "0",
]


def tokenized_samples(tokenizer, conversations: list, tokens: int, max_length: int) -> list[dict]:
    """Conversations in order, tokenised with draftsmith's chat masking, until ``tokens`` tokens
    (samples with no assistant token are skipped)."""
    from draftsmith.distill.data.samples import tokenize_conversation

    samples, total = [], 0
    for messages in conversations:
        sample = tokenize_conversation(tokenizer, messages, max_length)
        if len(sample["input_ids"]) < 2 or not any(sample["loss_mask"]):
            continue
        samples.append(sample)
        total += len(sample["input_ids"])
        if total >= tokens:
            break
    return samples


@torch.no_grad()
def write_peer_data(
    target,
    samples: list[dict],
    taps: tuple[int, ...],
    data_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """Write ``samples`` with the target's hidden states in speculators' format (module docstring)
    into ``data_dir``; returns the sizes written."""
    from draftsmith.distill.target.frozen import FeatureTaps

    (data_dir / "hidden_states").mkdir(parents=True, exist_ok=True)
    want = FeatureTaps(final_hidden=False, prenorm_hidden=True, layers=tuple(taps))
    freq: Counter = Counter()
    for i, sample in enumerate(samples):
        ids = torch.tensor(sample["input_ids"], dtype=torch.long)  # [T]
        feats = target.features(ids[None], torch.ones_like(ids)[None], want)
        stack = [feats.layer_hidden[t][0] for t in taps] + [feats.prenorm_hidden[0]]  # 4 x [T, H]
        save_file(
            {
                "token_ids": ids,
                "hidden_states": torch.stack(stack, 1).to(dtype).contiguous(),
            },  # [T, 4, H]
            str(data_dir / "hidden_states" / f"hs_{i}.safetensors"),
        )
        freq.update(t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m)
    (data_dir / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    torch.save(dict(freq), data_dir / "token_freq.pt")
    return {
        "samples": len(samples),
        "tokens": sum(len(s["input_ids"]) for s in samples),
        "loss_tokens": sum(sum(s["loss_mask"]) for s in samples),
        "distinct_tokens": len(freq),
    }


def trainer_flags(
    verifier: str,
    data_dir: Path,
    save_dir: Path,
    taps: tuple[int, ...],
    args: argparse.Namespace,
    total_seq_len: int,
) -> list[str]:
    """The ``speculators.train`` command line: ours (taps, sizes, budget) + the CPU and draft-layer
    flags."""
    flags = [
        "--speculator-type",
        "eagle3",
        "--verifier-name-or-path",
        verifier,
        "--data-path",
        str(data_dir),
        "--save-path",
        str(save_dir),
        "--log-dir",
        str(save_dir / "logs"),
        "--target-layer-ids",
        *map(str, taps),
        "--ttt-steps",
        str(args.ttt_steps),
        "--epochs",
        str(args.epochs),
        "--lr",
        str(args.lr),
        "--total-seq-len",
        str(total_seq_len),
        "--hidden-states-dtype",
        args.hs_dtype,
        "--seed",
        str(args.seed),
        *CPU_FLAGS,
        *LAYER_FLAGS,
    ]
    if args.draft_vocab_size:
        flags += ["--draft-vocab-size", str(args.draft_vocab_size)]
    return flags + list(args.trainer_arg)


def run_trainer(
    data_dir: Path, flags: list[str], python: Path, timeout_s: float, log_path: Path
) -> None:
    """Run the wrapper in the speculators venv; a failure raises with the last lines of its log (the
    reason)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "", "TOKENIZERS_PARALLELISM": "false"}
    with log_path.open("w") as log:
        proc = subprocess.run(
            [str(python), "-c", WRAPPER, str(data_dir), *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"speculators.train exited {proc.returncode} (log {log_path}):\n{tail}")


def last_checkpoint(save_dir: Path) -> Path:
    """The newest epoch folder the trainer saved (``SAVE/<epoch>/`` with config.json +
    model.safetensors)."""
    epochs = [
        d
        for d in save_dir.iterdir()
        if d.is_dir() and d.name.isdigit() and (d / "config.json").is_file()
    ]
    if not epochs:
        raise RuntimeError(f"speculators.train saved no checkpoint under {save_dir}")
    return max(epochs, key=lambda d: int(d.name))


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
    data_dir, save_dir = args.out / "data", args.out / "speculators"
    kept = kept_report(args.out, samples)  # a re-run keeps the finished stages of the same plan
    if kept.get("data"):
        report = kept
    else:
        sizes = write_peer_data(target, samples, taps, data_dir, getattr(torch, args.hs_dtype))
        report = {
            "target": folder,
            "taps": list(taps),
            "data": sizes,
            "seconds": {"data": time.perf_counter() - start},
        }
        write_report(args.out, report)
    flags = trainer_flags(
        folder, data_dir, save_dir, taps, args, max(len(s["input_ids"]) for s in samples)
    )
    report["trainer_command"] = ["python", "-m", "speculators.train", *flags]
    if "train" not in report["seconds"]:
        shutil.rmtree(
            save_dir, ignore_errors=True
        )  # a killed trainer's partial epochs: it cannot resume them
        save_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        run_trainer(
            data_dir, flags, args.speculators_python, args.timeout, args.out / "speculators.log"
        )
        report["seconds"]["train"] = time.perf_counter() - start
        write_report(args.out, report)
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
