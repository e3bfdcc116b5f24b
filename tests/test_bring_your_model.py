"""docs/BRING_YOUR_MODEL.md's worked example runs as written: its commands are read from the
document, step 1's hub download is replaced by a tiny random Qwen2 folder built in-process, and
steps 2-4 run as subprocesses (with a few overrides appended that keep training and the bench
short)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import transformers as tf
from conftest import make_conversations

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "BRING_YOUR_MODEL.md"
FOLDER = "/models/qwen2.5-0.5b"  # the document's model folder, replaced by the tiny one
SHORT_TRAIN = [
    "target.dtype=fp32",
    "data.limit=null",
    "data.max_length=48",
    "data.batch_size=4",
    "data.val_fraction=0.1",
    "trainer.max_steps=2",
    "run.checkpoint_every=2",
    "run.final_eval_batches=1",
    "validation.served_tau.every=0",
]
SHORT_BENCH = ["--num-prompts", "1", "--max-new-tokens", "8", "--skip-hf", "--dtype", "fp32"]


def example_commands() -> list[list[str]]:
    """The worked example's commands, continuation lines joined and comments dropped."""
    text = DOC.read_text(encoding="utf-8").split("## Worked example", 1)[1]
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    joined = re.sub(r"\\\n\s*", " ", block)
    return [
        shlex.split(line)
        for line in joined.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def tiny_qwen2(folder: Path, tokenizer: tf.PreTrainedTokenizerBase) -> None:
    """Step 1 without a hub: a random tiny Qwen2 and the test tokenizer, saved as save_pretrained
    writes them."""
    config = tf.Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    tf.Qwen2ForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def run(cmd: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
    )
    assert proc.returncode == 0, (
        f"{shlex.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    return proc


def test_the_worked_example_runs_as_written(tmp_path, tiny_tokenizer):
    download, support, train, bench = example_commands()
    # step 1: the hub snapshot
    assert download[:2] == ["python", "-c"] and "from_pretrained(n)" in download[2]
    model = tmp_path / "qwen2.5-0.5b"
    tiny_qwen2(model, tiny_tokenizer)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in make_conversations(40)))

    def mine(cmd: list[str]) -> list[str]:
        cmd = [a.replace(FOLDER, str(model)) for a in cmd]
        head = [sys.executable] if cmd[0] == "python" else [sys.executable, "-m", "draftsmith.cli"]
        assert cmd[0] in ("python", "draftsmith"), cmd
        return head + cmd[1:]

    # step 2: the lean decoder serves a Qwen2
    assert run(mine(support), tmp_path).stdout.strip() == "None"
    assert train[:3] == ["draftsmith", "train", "recipe=medusa"]
    run([*mine(train), f"data={data}", *SHORT_TRAIN], tmp_path)  # step 3
    assert (tmp_path / "outputs" / "qwen-medusa" / "export" / "config.json").is_file()
    assert bench[:3] == ["draftsmith", "bench", "export"]
    out = tmp_path / "bench"
    proc = run([*mine(bench), *SHORT_BENCH, "--out", str(out)], tmp_path)  # step 4
    result = json.loads((out / "bench.json").read_text())
    assert (
        result["backend"]["decoder_backend"] == "lean"
        and "lean decoder supports" in result["backend"]["decoder_reason"]
    )
    assert result["lossless"] is True and result["lossless_oracle"] is True, result[
        "lossless_detail"
    ]
    assert "lean" in proc.stdout
