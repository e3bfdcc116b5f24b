"""`draftsmith generate` and `draftsmith bench` as subprocesses on a tiny target: generate prints
tau and which linears ran; bench times in bf16 and checks losslessness in fp32 (with the oracle),
sweeps fixed depths beside the cost-aware default, profiles a step, and names a missing export."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.runtime.serving import hf_fastest_dtype

pytestmark = pytest.mark.unit
CLI = [sys.executable, "-m", "draftsmith.cli"]


@pytest.mark.e2e  # a draftsmith subprocess
def test_cli_generate_prints_tau_and_the_backend(medusa_export):
    gen = subprocess.run(
        [
            *CLI,
            "generate",
            "--drafter",
            str(medusa_export),
            "--prompt",
            "hello world",
            "--max-new-tokens",
            "8",
            "--verbose",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert "tau" in gen.stderr
    assert (
        "[linear_backend]" in gen.stderr
        and "[linear_reason]" in gen.stderr
        and "[cpu]" in gen.stderr
    )


def bench_cli(export: Path, prompts: Path, out: Path) -> subprocess.CompletedProcess:
    """`draftsmith bench` timed in bf16 with an fp32 lossless check, a profile and a depth sweep."""
    return subprocess.run(
        [
            *CLI,
            "bench",
            "--drafter",
            str(export),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "8",
            "--dtype",
            "bf16",
            "--lossless-dtype",
            "fp32",
            "--profile",
            "--sweep-k",
            "1,2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.e2e  # a draftsmith subprocess
def test_cli_bench_times_in_bf16_and_checks_losslessness_in_fp32(
    medusa_export, bench_prompts_file, tmp_path
):
    bench = bench_cli(medusa_export, bench_prompts_file, tmp_path / "b")
    assert bench.returncode == 0, bench.stderr[-2000:]
    assert (
        "| tau" in bench.stdout
        and "| stop policy | tau |" in bench.stdout
        and "per speculative step" in bench.stdout
    )
    result = json.loads((tmp_path / "b" / "bench.json").read_text())
    # Timed in bf16, lossless verdict from a separate fp32 run against HF generate.
    assert result["dtype"] == "bfloat16" and result["lossless_detail"]["dtype"] == "fp32"
    # the fp32 check ran the oracle too
    assert result["lossless"] is True and result["lossless_oracle"] is True
    assert result["lossless_detail"]["oracle"]["tau"] > 2.0
    # The default stop policy is cost-aware: a depth (or plain decoding) chosen from costs measured
    # here.
    cm = result["cost_model"]
    assert cm["table"][0]["depth"] == 0 and cm["depth"] in [r["depth"] for r in cm["table"]]
    assert [r["policy"] for r in result["sweep"]][:3] == [
        "plain (runtime AR)",
        "fixed:1",
        "fixed:2",
    ]
    assert (
        result["sweep"][-1]["policy"].endswith("(in force)")
        and result["sweep"][0]["speedup_vs_runtime_ar"] == 1.0
    )
    assert result["profile"]["steps"] > 0 and result["profile"]["step_ms"] > 0
    assert result["hf_dtype"] == str(hf_fastest_dtype()[0]).replace(
        "torch.", ""
    )  # HF timed at its fastest dtype
    assert (
        result["backend"]["linear_backend"] == result["linear_backend"]
        and "hf" not in result["lossless_detail"]
    )


@pytest.mark.e2e  # a draftsmith subprocess
def test_cli_bench_of_a_missing_export_exits_2(tmp_path):
    missing = subprocess.run(
        [*CLI, "bench", "--drafter", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "does not exist" in missing.stderr
