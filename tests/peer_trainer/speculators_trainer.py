"""Stage 2 of the peer harness (:mod:`peer_speculators`): ``python -m speculators.train``'s
``main`` run in ``.cache/venv-speculators`` through :data:`WRAPPER`, on CPU, and the checkpoint it
saved.

Its trainer assumes an accelerator; the wrapper patches, in its own process and without touching
speculators' files: ``trainer.get_local_rank`` -> the CPU device (``Trainer`` moves the model and
every batch with ``.to(self.local_rank)``; an int means an accelerator), ``Trainer.device_type`` ->
``"cpu"`` (autocast falls back to ``"cuda"`` without an accelerator), and
``torch.accelerator.synchronize`` -> a no-op when there is no accelerator (the step timer calls it
on logged steps and it raises "Cannot access accelerator device when none is available"). Flags:
``--loss-implementation eager`` (the fused loss imports triton), ``--draft-attn-impl sdpa`` (flex
attention needs a compiler backend), ``--on-missing raise`` (the default asks a vLLM server for
missing hidden states), ``--num-workers 0``; and the draft layer draftsmith's runtime computes:
``--no-norm-before-residual --no-norm-before-fc --no-norm-output --full-attention-indices 0`` (the
trainer's eagle3 defaults are the EAGLE 3.1 variant, which ``draftsmith import`` refuses with the
flag to change). Its provenance patch file is turned off: the venv sits inside draftsmith's clone,
so speculators would copy the clone's uncommitted diff into the output.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
