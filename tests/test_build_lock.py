"""The fused CPU layer's build lock: a build killed or paused mid-way never makes later processes
wait for ever (torch's own lock file records no owner)."""

from __future__ import annotations

import fcntl
import hashlib
import subprocess
import sys
import time
import types

import pytest
import torch

from draftsmith.kernels import cpu_layer

pytestmark = pytest.mark.unit


def test_a_lock_file_left_by_a_killed_build_does_not_block_the_next_load(tmp_path, monkeypatch):
    """torch's ``lock`` left behind (fresh, so no age rule could tell it is stale) is removed under
    the baton, and the build goes ahead."""
    monkeypatch.setenv("DRAFTSMITH_EXTENSIONS_DIR", str(tmp_path))
    seen = {}

    def fake_load(name, build_directory, **_):
        seen["lock_left"] = (tmp_path / name / "lock").exists()
        return types.SimpleNamespace()

    monkeypatch.setattr("torch.utils.cpp_extension.load", fake_load)
    cpu_layer._load.cache_clear()
    source = cpu_layer.SOURCE.read_bytes() + torch.__version__.encode()
    name = f"draftsmith_cpu_layer_avx2_{hashlib.sha256(source).hexdigest()[:12]}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "lock").write_text("")
    try:
        module = cpu_layer._load("avx2")
    finally:
        cpu_layer._load.cache_clear()
    assert module.isa == "avx2" and seen == {"lock_left": False}


def test_the_baton_is_released_when_its_holder_is_killed(tmp_path):
    """A holder killed with SIGKILL mid-build: the kernel drops its flock, the next process gets it
    at once."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from draftsmith.kernels.cpu_layer import build_baton\n"
            "with build_baton(Path(sys.argv[1])):\n"
            "    print('held', flush=True); time.sleep(600)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / "lock").write_text("")  # what torch would have left mid-build
        holder.kill()
        holder.wait(timeout=30)
        start = time.monotonic()
        with cpu_layer.build_baton(tmp_path, wait_s=30):
            assert not (tmp_path / "lock").exists()
        assert time.monotonic() - start < 10
    finally:
        holder.kill()


def test_a_holder_that_never_finishes_is_refused_with_its_pid_after_the_wait(tmp_path):
    """A paused (SIGSTOP) or hung holder: the waiter gives up after ``wait_s`` with a one-line
    reason naming the holder, and the caller falls back to torch (CpuLayerUnavailable)."""
    with open(tmp_path / cpu_layer.BATON, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.write("4242")
        handle.flush()
        with pytest.raises(cpu_layer.CpuLayerUnavailable) as err:
            with cpu_layer.build_baton(tmp_path, wait_s=0.5):
                pass
    message = str(err.value)
    assert "pid 4242" in message and "running torch" in message and "\n" not in message
