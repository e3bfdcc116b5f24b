"""``tests/gpu_check/gpu_check.py`` on the CPU: its CUDA path cannot run here, so the same stages
run on a tiny model (``--device cpu --tiny``) to prove the logic: every stage is reported with
pass/fail and numbers, an injected failure is reported while later stages still run, time limits
hold, and the shell wrapper refuses a machine without a GPU with one clear line."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "gpu_check" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    """The script imported as a module (it is not part of the package)."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


@pytest.fixture()
def ctx(gpu_check, tmp_path):
    plan = gpu_check.Plan.make("cpu", tiny=True)
    return gpu_check.Context(plan, tmp_path, tmp_path, tmp_path / "log.txt", {"injected"})


def test_run_stage_isolates_failures_and_enforces_time_limits(gpu_check, ctx):
    def boom(c):
        raise ValueError("broken on purpose")

    def slow(c):
        time.sleep(5)

    def fine(c):
        return {"numbers": {"tokens_per_s": 12.5}, "note": "ok"}

    records = [
        gpu_check.run_stage("boom", boom, ctx, 10),
        gpu_check.run_stage("slow", slow, ctx, 0.3),
        gpu_check.run_stage("injected", fine, ctx, 10),
        gpu_check.run_stage("fine", fine, ctx, 10),
    ]
    assert [r["status"] for r in records] == ["fail", "fail", "fail", "pass"]
    assert "ValueError: broken on purpose" in records[0]["error"]
    assert "StageTimeout" in records[1]["error"] and records[1]["seconds"] < 2
    assert "injected failure" in records[2]["error"]
    assert records[3]["numbers"] == {"tokens_per_s": 12.5}
    assert "broken on purpose" in ctx.log_path.read_text()  # the traceback goes to the log
    table = gpu_check.markdown(
        {
            "device": "cpu",
            "tiny": True,
            "device_name": "x",
            "ok": False,
            "total_seconds": 1.0,
            "target": "t",
            "stages": records,
        }
    )
    assert (
        table.count("| FAIL |") == 3 and "| fine | PASS |" in table and "tokens_per_s=12.5" in table
    )


def test_helpers(gpu_check, tmp_path):
    from draftsmith.recipes import RECIPES

    assert gpu_check.recipe_names() == sorted(set(RECIPES) - set(gpu_check.NEEDS_INPUT))
    assert {"medusa", "eagle", "eagle3", "hydra", "clover2", "kangaroo"} <= set(
        gpu_check.recipe_names()
    )
    assert gpu_check.recipe_names(["medusa", "eagle"]) == ["eagle", "medusa"]
    with pytest.raises(ValueError, match="not among the standalone recipes"):
        gpu_check.recipe_names(["specdecpp"])
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite tests="7" failures="1" errors="0" skipped="2"/></testsuites>'
    )
    assert gpu_check.junit_counts(xml) == {"passed": 4, "failed": 1, "errors": 0, "skipped": 2}
    noisy = 'Epoch 0: 100%\n{"x": 1}\n{\n  "recipe": "medusa",\n  "steps": 3\n}\nbye\n'
    assert gpu_check.last_json(noisy) == {"recipe": "medusa", "steps": 3}
    assert gpu_check.fmt(7.1e-7) == "7.10e-07" and gpu_check.fmt(123.456) == "123.5"
    assert "tests/test_gpu.py" in gpu_check.gpu_test_files()


def test_tiny_cpu_run_reports_every_stage_and_survives_an_injected_failure(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--device",
        "cpu",
        "--tiny",
        "--out",
        str(out),
        "--work",
        str(tmp_path / "w"),
        "--fail-stage",
        "bench:eagle",
        "--recipes",
        "eagle,medusa",
    ]  # a stage after the failure still runs
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    stages = {r["stage"]: r for r in report["stages"]}
    recipes = ("eagle", "medusa")
    expected = [
        "setup",
        "pytest-gpu",
        "runtime-kernels",
        *(s for r in recipes for s in (f"train:{r}", f"bench:{r}")),
    ]
    assert list(stages) == expected and report["ok"] is False
    failed = [name for name, r in stages.items() if r["status"] != "pass"]
    assert failed == ["bench:eagle"], {n: stages[n]["error"] for n in failed}
    assert "injected failure" in stages["bench:eagle"]["error"]
    # Numbers of every kind the GPU run reports.
    assert stages["pytest-gpu"]["numbers"]["failed"] == 0
    for r in recipes:
        assert (
            stages[f"train:{r}"]["numbers"]["steps"] == 2
            and stages[f"train:{r}"]["numbers"]["loss"] > 0
        )
    kernels = stages["runtime-kernels"]["numbers"]
    assert kernels["fp32_max_logit_diff"] < 1e-3 and kernels["fp32_greedy_equal"] == "2/2"
    assert kernels["torch_ar_tok_per_s"] > 0 and kernels["triton_fwd16_ms"] > 0
    for r in ("medusa",):  # a stage after the injected failure still ran
        bench = stages[f"bench:{r}"]["numbers"]
        assert bench["spec_tok_per_s"] > 0 and bench["hf_tok_per_s"] > 0 and bench["tau"] >= 1
        assert bench["lossless_fp32_vs_ar"] == "2/2"
    table = (out / "gpu_check.md").read_text()
    # header + one row per stage
    assert table in proc.stdout and table.count("\n| ") == len(expected) + 1
    assert "| bench:eagle | FAIL |" in table and "| runtime-kernels | PASS |" in table


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without a GPU"
)
def test_shell_wrapper_stops_with_one_clear_line_without_a_gpu(tmp_path):
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_CHECK_SKIP_WHEELS": "1",
        "GPU_CHECK_PKG": str(tmp_path),
        "OUT": str(tmp_path / "out"),
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "tests" / "gpu_check" / "gpu_check.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 3
    assert (
        proc.stderr.strip().startswith("gpu-check: ") and len(proc.stderr.strip().splitlines()) == 1
    )
    assert (
        tmp_path / "draftsmith"
    ).resolve() == ROOT.resolve()  # the package symlink it imports through
