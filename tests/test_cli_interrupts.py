"""Ctrl-C in every long serving and data command: exit 130 and one line naming what was kept and the
command that resumes it, never a KeyboardInterrupt traceback. A real SIGINT into a ``draftsmith
regenerate`` subprocess on the tiny target (e2e), and an interrupt raised inside each other
command's work in-process (unit)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import make_conversations

from draftsmith.cli import main
from draftsmith.datagen import conversation_replies as replies

pytestmark = pytest.mark.unit


def _interrupted(capsys, argv: list[str]) -> str:
    """Run ``argv`` in-process; assert exit 130 and one stderr line without a traceback; return that
    line."""
    assert main(argv) == 130
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("draftsmith ")]
    assert len(lines) == 1 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    return lines[0]


def _raise(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_ctrl_c_while_loading_is_one_line_with_the_rerun(
    capsys, monkeypatch, medusa_export, tiny_target_dir, tmp_path, command
):
    from draftsmith.runtime import serving

    monkeypatch.setattr(serving, "load_runtime", _raise)
    argv = [
        command,
        "--drafter",
        str(medusa_export),
        "--target",
        str(tiny_target_dir),
        "--dtype",
        "fp32",
    ]
    argv += ["--prompt", "hi"] if command == "generate" else ["--out", str(tmp_path / "b")]
    line = _interrupted(capsys, argv)
    assert line.startswith(f"draftsmith {command}: interrupted (Ctrl-C): ")
    assert line.endswith("rerun with: draftsmith " + " ".join(argv)), line
    if command == "bench":
        assert f"nothing was written to {tmp_path / 'b'}" in line


def test_ctrl_c_in_engine_check_names_the_kept_conversion(
    capsys, monkeypatch, medusa_export, tmp_path
):
    from draftsmith.cli import engines
    from draftsmith.evals import engine_check

    gguf = tmp_path / "gguf"
    gguf.mkdir()
    (gguf / "gguf.json").write_text("{}")
    monkeypatch.setattr(
        engines, "_gguf_files", lambda export, folder, tmp: {"target": "t", "draft": "d"}
    )
    monkeypatch.setattr(
        engines, "_check_inputs", lambda args: None
    )  # a Medusa export stands in for an EAGLE-3 one
    monkeypatch.setattr(engine_check, "engine_check", _raise)
    line = _interrupted(capsys, ["engine-check", str(medusa_export), "--gguf", str(gguf)])
    assert (
        f"kept the GGUF conversion in {gguf}" in line
        and "rerun with: draftsmith engine-check" in line
    )


def test_ctrl_c_in_regenerate_names_the_partial_file_and_the_resuming_command(
    capsys, monkeypatch, tiny_target_dir, tiny_data_file, tmp_path
):
    calls = {"n": 0}
    real = replies.generate_ar

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(replies, "generate_ar", interrupted)
    out = tmp_path / "o.jsonl"
    argv = [
        "regenerate",
        "--data",
        str(tiny_data_file),
        "--out",
        str(out),
        "--target",
        str(tiny_target_dir),
        "--limit",
        "5",
        "--max-new-tokens",
        "4",
        "--dtype",
        "fp32",
        "--batch-size",
        "1",
    ]
    line = _interrupted(capsys, argv)
    assert line == (
        "draftsmith regenerate: interrupted (Ctrl-C): kept 2 complete conversations in"
        f" {out}.partial (the same command resumes after the last one); resume with: draftsmith "
        + " ".join(argv)
    )
    monkeypatch.setattr(replies, "generate_ar", real)
    assert main(argv) == 0  # the line's command resumes
    assert [json.loads(r)["source_index"] for r in out.read_text().splitlines()] == [0, 1, 2, 3, 4]


@pytest.mark.e2e  # a draftsmith subprocess
def test_a_real_sigint_into_regenerate_exits_130_with_one_line(tiny_target_dir, tmp_path):
    data = tmp_path / "many.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in make_conversations(300)))
    out = tmp_path / "o.jsonl"
    argv = [
        "regenerate",
        "--data",
        str(data),
        "--out",
        str(out),
        "--target",
        str(tiny_target_dir),
        "--max-new-tokens",
        "48",
        "--dtype",
        "fp32",
        "--batch-size",
        "1",
    ]
    # a foreground user's Ctrl-C: a shell starts background jobs with SIGINT ignored, and Python
    # keeps that
    proc = subprocess.Popen(
        [sys.executable, "-m", "draftsmith.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    partial = Path(f"{out}.partial")
    deadline = time.monotonic() + 300
    # wait for the first complete line, then Ctrl-C
    while proc.poll() is None and time.monotonic() < deadline:
        if partial.is_file() and partial.read_bytes().count(b"\n") >= 1:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    lines = [
        line for line in err.splitlines() if line.startswith("draftsmith regenerate: interrupted")
    ]
    assert len(lines) == 1 and f"in {partial} (the same command resumes" in lines[0], err
    assert lines[0].endswith("resume with: draftsmith " + " ".join(argv))
    assert not out.exists() and partial.read_bytes().endswith(b"\n")
