"""``make gpu-train`` (a), speculators' side: speculators 0.9.0's own EAGLE-3 trainer timed on
the same device and shapes as ours (:mod:`gpu_train_speed`).

speculators trains from hidden states computed beforehand (its data format:
``hidden_states/hs_i.safetensors``), so its rate compares with our drafter-only (feature-cache)
rate. Its hidden states here are random (their values do not change the speed). Its trainer runs in
a child process (the wrapper of tests/peer_trainer/speculators_trainer.py) with its step timer
patched to record a synchronised timestamp at two step starts (after the warm-up steps, and
``timed`` steps later): the rate is ``timed * total_seq_len / seconds`` (its rows are packed full to
``--total-seq-len``). Its own per-step synchronisation (``--log-freq``) is set past the run, as a
fast run would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

# Put before tests/peer_trainer/speculators_trainer.py's WRAPPER (which builds the dataset, patches
# for the CPU and runs the trainer): argv = [result.json, warm, timed, data_dir, *trainer flags].
# Records a synchronised timestamp at the start of step ``warm`` and of step ``warm + timed`` (the
# step timer's reset opens each step) and writes them at exit.
TIMER_PATCH = r"""
import atexit, json, sys, time
from pathlib import Path
import torch
import speculators.train.trainer as _timed_trainer

_out, _warm, _timed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
del sys.argv[1:4]
_marks, _calls = {}, [0]
_original_reset = _timed_trainer._StepTimer.reset


def _reset(self, enabled):
    if _calls[0] in (_warm, _warm + _timed):
        if torch.accelerator.current_accelerator() is not None:
            torch.accelerator.synchronize()
        _marks[_calls[0]] = time.perf_counter()
    _calls[0] += 1
    return _original_reset(self, enabled)


def _write():
    if _warm + _timed in _marks:
        seconds = _marks[_warm + _timed] - _marks[_warm]
        Path(_out).write_text(json.dumps({"seconds": seconds, "steps": _timed}))


_timed_trainer._StepTimer.reset = _reset
atexit.register(_write)
"""


def peer_wrapper() -> str:
    """The timing patch, then tests/peer_trainer/speculators_trainer.py's own wrapper (one copy of
    how speculators is driven)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "peer_trainer" / "speculators_trainer.py"
    spec = importlib.util.spec_from_file_location("speculators_trainer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return TIMER_PATCH + module.WRAPPER


def write_peer_data(
    target: Path, chats: list[dict], out: Path, taps: tuple[int, ...], tokens: int
) -> dict:
    """speculators' data folder for ``chats`` (tokenised with draftsmith's chat masking) until
    ``tokens`` tokens, with random bf16 hidden states [T, 4, H]."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from draftsmith.distill.data.samples import tokenize_conversation

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    samples, total, freq = [], 0, {}
    generator = torch.Generator().manual_seed(0)
    for chat in chats:
        messages = [
            {"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
            for t in chat["conversations"]
        ]
        sample = tokenize_conversation(tokenizer, messages, 1 << 20)
        ids = torch.tensor(sample["input_ids"])
        states = torch.randn(len(ids), len(taps) + 1, hidden, generator=generator).to(
            torch.bfloat16
        )
        save_file(
            {"token_ids": ids, "hidden_states": states},
            str(out / "hidden_states" / f"hs_{len(samples)}.safetensors"),
        )
        for t, m in zip(sample["input_ids"], sample["loss_mask"]):
            freq[t] = freq.get(t, 0) + int(m)
        samples.append(sample)
        total += len(ids)
        if total >= tokens:
            break
    (out / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    torch.save({k: v for k, v in freq.items() if v}, out / "token_freq.pt")
    return {"samples": len(samples), "tokens": total}


def peer_flags(
    target: Path,
    data: Path,
    save: Path,
    budget: int,
    max_steps: int,
    draft_vocab: int,
    taps: tuple[int, ...],
    cpu: bool,
) -> list[str]:
    """``speculators.train``'s flags for one budget (``--total-seq-len``), our drafter's shape
    (``cpu``: the CPU rehearsal's flags: eager loss, SDPA attention, no loader workers)."""
    flags = [
        "--speculator-type",
        "eagle3",
        "--verifier-name-or-path",
        str(target),
        "--data-path",
        str(data),
        "--save-path",
        str(save),
        "--log-dir",
        str(save / "logs"),
        "--target-layer-ids",
        *map(str, taps),
        "--ttt-steps",
        "3",
        "--epochs",
        "1",
        "--max-steps",
        str(max_steps),
        "--total-seq-len",
        str(budget),
        "--log-freq",
        "100000",
        "--on-missing",
        "raise",
        "--draft-vocab-size",
        str(draft_vocab),
        "--no-norm-before-residual",
        "--no-norm-before-fc",
        "--no-norm-output",
        "--full-attention-indices",
        "0",
        "--no-resume-from-checkpoint",
    ]
    if cpu:
        flags += [
            "--loss-implementation",
            "eager",
            "--draft-attn-impl",
            "sdpa",
            "--num-workers",
            "0",
        ]
    return flags


def run_peer(
    python: str,
    flags: list[str],
    result: Path,
    warm: int,
    timed: int,
    data: Path,
    timeout: float,
    log: Path,
    cpu: bool,
) -> int | str:
    """Run speculators' trainer with its step timer patched in (:func:`peer_wrapper`), its output
    appended to ``log``; the exit status, or why it has none."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if cpu:  # the rehearsal runs speculators in its own venv: nothing of ours on its path
        env["PYTHONPATH"] = ""
    with log.open("a") as handle:
        handle.write(f"\n$ speculators.train {' '.join(flags)}\n")
        handle.flush()
        try:
            proc = subprocess.run(
                [
                    python,
                    "-c",
                    peer_wrapper(),
                    str(result),
                    str(warm),
                    str(timed),
                    str(data),
                    *flags,
                ],
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=timeout,
                check=False,
            )
            return proc.returncode
        except subprocess.TimeoutExpired:
            return f"timeout after {timeout:.0f} s"


def peer_row(budget: int, code: int | str, result: Path) -> dict[str, Any]:
    """One row of the throughput table from a peer run's exit and its timing file."""
    if code != 0 or not result.is_file():
        return {"budget": budget, "error": f"speculators.train exit {code} (see peer.log)"}
    timing = json.loads(result.read_text())
    return {
        "budget": budget,
        "tokens_per_s": round(timing["steps"] * budget / timing["seconds"], 1),
        "seconds": round(timing["seconds"], 3),
        "steps": timing["steps"],
    }


def peer_rows(
    python: str,
    target: Path,
    data: Path,
    budgets: list[int],
    work: Path,
    warm: int,
    timed: int,
    draft_vocab: int,
    taps: tuple[int, ...],
    timeout: float,
    log: Path,
    cpu: bool = False,
) -> list[dict[str, Any]]:
    """speculators' trainer at each budget (``--total-seq-len``); tokens/s from its patched step
    timer (``cpu``: the CPU rehearsal's flags: eager loss, SDPA attention, no loader workers)."""
    rows = []
    for budget in budgets:
        save = work / f"peer-{budget}"
        result = work / f"peer-{budget}.json"
        shutil.rmtree(
            save, ignore_errors=True
        )  # a run that resumed an earlier one's checkpoint would time nothing
        result.unlink(missing_ok=True)
        flags = peer_flags(target, data, save, budget, warm + timed + 1, draft_vocab, taps, cpu)
        code = run_peer(python, flags, result, warm, timed, data, timeout, log, cpu)
        rows.append(peer_row(budget, code, result))
    return rows


def peer_python() -> str:
    """speculators' interpreter: ``GPU_TRAIN_PEER_PYTHON``, else the test venv (CPU rehearsal), else
    this one."""
    explicit = os.environ.get("GPU_TRAIN_PEER_PYTHON")
    if explicit:
        return explicit
    venv = Path(__file__).resolve().parents[2] / ".cache" / "venv-speculators" / "bin" / "python"
    return str(venv) if venv.is_file() else sys.executable
