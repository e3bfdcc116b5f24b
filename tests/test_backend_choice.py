"""Backend and dtype choices for every CPU kind, by injecting the capability (no real AVX2 or ARM
machine needed)."""

from __future__ import annotations

import warnings

import pytest
import torch

from draftsmith.kernels import cpu_caps, cpu_layer
from draftsmith.runtime import serving as benchmark
from draftsmith.runtime.target.linear_ops import (
    choose_linear_ops,
    mkldnn_linear_available,
    plan_linear_backend,
)

pytestmark = pytest.mark.unit

SIZES = (64, 576, 1536)  # head_dim, hidden, intermediate of the embedded target
ZEN4 = cpu_caps.CpuCaps(
    "x86_64",
    frozenset("avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16".split()),
    "AMD EPYC 9004",
)
ZEN3 = cpu_caps.CpuCaps(
    "x86_64", frozenset("sse4_2 avx avx2 fma f16c bmi2".split()), "AMD EPYC 7003"
)
SKYLAKE_X = cpu_caps.CpuCaps(
    "x86_64", frozenset("avx avx2 fma avx512f avx512bw avx512vl avx512dq".split()), "Xeon"
)
GRAVITON = cpu_caps.CpuCaps("aarch64", frozenset("fp asimd sve bf16".split()), "Neoverse-V1")
OLD_X86 = cpu_caps.CpuCaps("x86_64", frozenset("sse2 sse4_2 avx".split()), "Sandy Bridge")


def plan(
    backend: str,
    caps: cpu_caps.CpuCaps,
    mkldnn_ok: bool | None = None,
    toolchain: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
):
    ok = caps.onednn_bf16 if mkldnn_ok is None else mkldnn_ok
    return plan_linear_backend(
        backend, dtype, device, SIZES, caps=caps, mkldnn_ok=ok, toolchain_reason=toolchain
    )


@pytest.mark.parametrize(
    ("caps", "label"),
    [
        (ZEN4, "cpp:avx512_bf16"),
        (ZEN3, "cpp:avx2"),
        (SKYLAKE_X, "cpp:avx2"),
        (GRAVITON, "dense"),
        (OLD_X86, "dense"),
    ],
)
def test_auto_picks_what_each_cpu_can_run(caps, label):
    chosen = plan("auto", caps)
    assert chosen.label == label
    assert chosen.reason  # always says why


def test_auto_without_a_compiler_falls_back_to_onednn_or_dense_and_says_why():
    # oneDNN runs on AVX512 BW/VL/DQ
    assert plan("auto", SKYLAKE_X, toolchain="no C++ compiler").kind == "mkldnn"
    zen3 = plan("auto", ZEN3, toolchain="no C++ compiler")
    assert (
        zen3.kind == "dense"
        and "no C++ compiler" in zen3.reason
        and "AVX512 BW+VL+DQ" in zen3.reason
    )
    assert zen3.fused_unavailable == "no C++ compiler"
    arm = plan("auto", GRAVITON)
    assert arm.kind == "dense" and "neither AVX512-BF16 nor AVX2+FMA" in arm.fused_unavailable


def test_fp32_and_cuda_always_take_dense_linears():
    assert plan("auto", ZEN4, dtype=torch.float32).kind == "dense"
    assert plan("auto", ZEN4, device="cuda").reason.startswith("CUDA")
    with pytest.raises(ValueError, match="needs bf16 weights on CPU.*linear_backend='dense'"):
        plan("cpp", ZEN4, dtype=torch.float32)


def test_forcing_a_backend_the_cpu_cannot_run_names_what_is_missing_and_what_to_use():
    with pytest.raises(
        ValueError,
        match=r"'mkldnn' cannot run: .*AVX512 BW\+VL\+DQ or AVX-NE-CONVERT.*avx2\+fma.*"
        r"linear_backend='cpp'",
    ):
        plan("mkldnn", ZEN3)
    with pytest.raises(
        ValueError, match=r"'cpp' cannot run: .*neither AVX512-BF16 nor AVX2\+FMA.*'dense'"
    ):
        plan("cpp", GRAVITON)
    with pytest.raises(ValueError, match=r"'cpp' cannot run: no C\+\+ compiler.*'mkldnn'"):
        plan("cpp", SKYLAKE_X, toolchain="no C++ compiler")
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        plan("fast", ZEN4)
    assert plan("mkldnn", SKYLAKE_X).kind == "mkldnn" and plan("cpp", ZEN3).isa == "avx2"


def test_mkldnn_availability_follows_the_cpu_not_the_op():
    assert not mkldnn_linear_available(
        torch.bfloat16, torch.device("cpu"), caps=ZEN3
    )  # the op exists, the ISA not
    assert not mkldnn_linear_available(torch.float32, torch.device("cpu"), caps=ZEN4)
    assert ZEN3.onednn_bf16 is False and SKYLAKE_X.onednn_bf16 and GRAVITON.onednn_bf16 is False


def test_fused_layer_variant_needs_its_instructions():
    assert cpu_layer.pick_isa(ZEN4)[0] == "avx512_bf16" and cpu_layer.pick_isa(ZEN3)[0] == "avx2"
    assert cpu_layer.pick_isa(GRAVITON)[0] is None
    assert "lacks AVX512-BF16" in cpu_layer.why_unavailable("avx512_bf16", caps=ZEN3)
    assert "lacks AVX2+FMA" in cpu_layer.why_unavailable("avx2", caps=OLD_X86)
    assert "unknown fused-layer variant" in cpu_layer.why_unavailable("sse9", caps=ZEN4)


@pytest.mark.parametrize(
    ("caps", "device", "want"),
    [
        (ZEN4, "cpu", torch.bfloat16),
        (ZEN3, "cpu", torch.float32),
        (SKYLAKE_X, "cpu", torch.float32),
        (GRAVITON, "cpu", torch.float32),
        (cpu_caps.CpuCaps("x86_64", frozenset({"amx_bf16", "avx2", "fma"})), "cpu", torch.bfloat16),
    ],
)
def test_auto_dtype_is_bf16_only_where_it_is_native(caps, device, want):
    dtype, why = cpu_caps.resolve_dtype("auto", device, caps)
    assert dtype == want and why.startswith("auto -> ")
    # explicit choices are kept
    assert cpu_caps.resolve_dtype("bf16", device, caps)[0] == torch.bfloat16
    with pytest.raises(ValueError, match="valid: auto, fp32"):
        cpu_caps.resolve_dtype("int3", device, caps)


def test_runtime_auto_dtype_takes_bf16_where_the_fused_layer_runs(monkeypatch):
    monkeypatch.setattr(cpu_caps, "probe", lambda: ZEN3)
    monkeypatch.setattr(cpu_layer, "why_unavailable", lambda isa=None, caps=None: None)
    dtype, why = benchmark.resolve_runtime_dtype("auto")
    assert dtype == torch.bfloat16 and "avx2" in why
    monkeypatch.setattr(cpu_layer, "why_unavailable", lambda isa=None, caps=None: "no C++ compiler")
    dtype, why = benchmark.resolve_runtime_dtype("auto")
    assert dtype == torch.float32 and "no C++ compiler" in why
    assert benchmark.hf_fastest_dtype()[0] == torch.float32  # HF's fair peer on this CPU is fp32


def test_cpuinfo_parsing_and_the_isa_cap(monkeypatch):
    flags, model = cpu_caps.parse_cpuinfo(
        "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2 fma\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2 fma\n"
    )
    assert flags == {"fpu", "avx2", "fma"} and model == "AMD EPYC 7B13"
    arm, _ = cpu_caps.parse_cpuinfo("processor : 0\nFeatures : fp asimd evtstrm aes bf16\n")
    assert "bf16" in arm and cpu_caps.parse_cpuinfo("nothing here\n") is None
    capped = cpu_caps.cap_at(ZEN4, "avx2")
    assert capped.cpu_layer_isa() == "avx2" and not capped.native_bf16 and not capped.onednn_bf16
    assert "fma" in capped.flags and "capped at avx2" in capped.source
    assert cpu_caps.cap_at(ZEN3, "avx512_bf16").flags == ZEN3.flags  # a cap never adds instructions
    with pytest.raises(ValueError, match="valid: generic, avx2, avx512, avx512_bf16"):
        cpu_caps.cap_at(ZEN4, "avx1024")
    monkeypatch.setenv(cpu_caps.ISA_ENV, "generic")
    cpu_caps.hardware.cache_clear()
    try:
        assert (
            cpu_caps.probe().cpu_layer_isa() is None
            and "capped at generic" in cpu_caps.probe().source
        )
    finally:
        monkeypatch.delenv(cpu_caps.ISA_ENV)
        cpu_caps.hardware.cache_clear()


def test_choose_warns_in_one_line_when_the_fused_layer_cannot_run(monkeypatch):
    monkeypatch.setattr(
        cpu_layer,
        "why_unavailable",
        lambda isa=None, caps=None: "no C++ compiler (c++/g++) on PATH",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ops, chosen = choose_linear_ops(
            "auto", torch.bfloat16, torch.device("cpu"), SIZES, False, caps=ZEN3
        )
    assert ops.name == "dense" and chosen.kind == "dense"
    assert (
        len(caught) == 1
        and "\n" not in str(caught[0].message)
        and "no C++ compiler" in str(caught[0].message)
    )


@pytest.mark.skipif(
    cpu_layer.why_unavailable("avx2") is not None, reason="this CPU cannot run the avx2 variant"
)
def test_a_decoder_capped_at_avx2_runs_the_avx2_variant_close_to_the_torch_path(
    monkeypatch, tmp_path
):
    from test_runtime_model import tiny_model

    from draftsmith.runtime.target.model import LeanDecoder

    tiny_model("Llama", tmp_path)
    capped = cpu_caps.cap_at(cpu_caps.probe(), "avx2")  # what DRAFTSMITH_CPU_ISA=avx2 does
    monkeypatch.setattr(cpu_caps, "probe", lambda: capped)
    fused = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ref = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend="dense")
    assert fused.linear_ops == "cpp:avx2" and "avx2 variant" in fused.linear_plan.reason
    ids = torch.tensor([5, 6, 7, 8, 9])
    got = fused(ids, fused.allocate_cache(8)).logits
    want = ref(ids, ref.allocate_cache(8)).logits
    torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=0.05)
    with pytest.raises(ValueError, match="'mkldnn' cannot run"):
        LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend="mkldnn")


AVX2_MACHINE = {
    "DRAFTSMITH_CPU_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


@pytest.mark.e2e  # a train.py / draftsmith subprocess
def test_an_avx2_machine_simulated_end_to_end_generates_with_what_it_can_run(tiny_target_dir):
    """torch, oneDNN and our probe all limited to AVX2 (oneDNN then refuses bf16 reorders exactly as
    on a Zen 3): the runtime must pick a backend that runs, and say which."""
    import os
    import subprocess
    import sys

    env = {**os.environ, **AVX2_MACHINE}
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "from draftsmith.kernels import cpu_caps; "
                "print(cpu_caps.onednn_bf16_runs(), cpu_caps.probe().best_isa())"
            ),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert probe.returncode == 0 and probe.stdout.split() == ["False", "avx2+fma"], probe.stderr[
        -2000:
    ]
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftsmith.cli",
            "generate",
            "--target",
            str(tiny_target_dir),
            "--prompt",
            "hello world",
            "--max-new-tokens",
            "6",
            "--verbose",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert gen.returncode == 0, gen.stderr[-3000:]
    report = dict(
        line[1:].split("] ", 1) for line in gen.stderr.splitlines() if line.startswith("[")
    )
    want = "cpp:avx2" if cpu_layer.why_unavailable("avx2") is None else "dense"
    assert report["linear_backend"] == want and report["dtype"] == (
        "bfloat16" if want != "dense" else "float32"
    )
    assert "mkldnn" not in report["linear_backend"]
