"""Every CPU kind the project meets, on any machine: each capability branch (AVX2, AVX512-BF16, AMX
with AVX512-FP16, ARM, an old x86) is taken by injecting the kind (``cpu_caps.injected``), and the
choices it makes are the kind's; a branch whose native code this CPU cannot run is refused by the
hardware check and the fallback it lands on runs here, so a new CPU kind is never the first to take
a branch. The fused layer's variants are compiled even where they cannot run."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_speculative import tiny_llama

from draftsmith.kernels import cpu_caps, cpu_layer
from draftsmith.runtime.serving import resolve_runtime_dtype
from draftsmith.runtime.target.fast_linear import accelerate_linears
from draftsmith.runtime.target.linear_ops import plan_linear_backend
from draftsmith.runtime.target.model import LeanDecoder, ModelConfig

pytestmark = pytest.mark.unit

AVX2 = "avx avx2 fma f16c".split()
AVX512_BF16 = [
    *AVX2,
    *"avx512f avx512bw avx512vl avx512dq avx512cd avx512_vnni avx512_bf16".split(),
]
# name: (caps, fused variant, native bf16, oneDNN bf16, auto runtime dtype, auto training dtype)
KINDS = {
    "zen2_avx2": (
        cpu_caps.CpuCaps("x86_64", frozenset(AVX2), "AMD EPYC 7002"),
        "avx2",
        False,
        False,
        torch.bfloat16,
        torch.float32,
    ),
    "zen4_avx512_bf16": (
        cpu_caps.CpuCaps("x86_64", frozenset(AVX512_BF16), "AMD EPYC 9004"),
        "avx512_bf16",
        True,
        True,
        torch.bfloat16,
        torch.bfloat16,
    ),
    "xeon_amx_fp16": (
        cpu_caps.CpuCaps(
            "x86_64",
            frozenset(
                [*AVX512_BF16, *"avx512_fp16 amx_bf16 amx_tile amx_int8 avx_ne_convert".split()]
            ),
            "Intel Xeon Platinum 8480+",
        ),
        "avx512_bf16",
        True,
        True,
        torch.bfloat16,
        torch.bfloat16,
    ),
    "graviton_arm": (
        cpu_caps.CpuCaps("aarch64", frozenset("fp asimd sve bf16".split()), "Neoverse-V1"),
        None,
        False,
        False,
        torch.float32,
        torch.float32,
    ),
    "old_x86": (
        cpu_caps.CpuCaps("x86_64", frozenset("sse2 sse4_2 avx".split()), "Sandy Bridge"),
        None,
        False,
        False,
        torch.float32,
        torch.float32,
    ),
}
HARDWARE = cpu_caps.hardware()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_makes_its_own_choices(kind):
    caps, variant, native, onednn, runtime_dtype, training_dtype = KINDS[kind]
    with cpu_caps.injected(caps) as shown:
        assert cpu_caps.probe() is shown and shown.source == "injected"
        assert (
            caps.cpu_layer_isa() == variant
            and caps.native_bf16 == native
            and caps.onednn_bf16 == onednn
        )
        # what every caller without a caps argument now sees
        assert cpu_layer.pick_isa()[0] == variant
        plan = plan_linear_backend(
            "auto", torch.bfloat16, "cpu", (16, 64, 128), mkldnn_ok=onednn, toolchain_reason=None
        )
        assert plan.label == (f"cpp:{variant}" if variant else "dense")
        fused_builds = cpu_layer.why_unavailable() is None
        dtype, why = resolve_runtime_dtype("auto")
        assert dtype == (runtime_dtype if fused_builds or native else torch.float32), why
        assert cpu_caps.resolve_dtype("auto", "cpu")[0] == training_dtype
    assert cpu_caps.probe() is not shown  # the injection ends with the block


def test_avx512_fp16_and_amx_are_capped_with_their_level():
    amx = KINDS["xeon_amx_fp16"][0]
    capped = cpu_caps.cap_at(amx, "avx2")
    assert (
        not capped.has("avx512_fp16")
        and not capped.has("amx_bf16")
        and capped.cpu_layer_isa() == "avx2"
    )
    assert cpu_caps.cap_at(amx, "avx512").native_bf16 is False
    assert KINDS["xeon_amx_fp16"][0].best_isa() == "avx512_bf16"
    amx_only = cpu_caps.CpuCaps(
        "x86_64", frozenset([*AVX2, "amx_bf16", "amx_tile"])
    )  # AMX without AVX512-BF16
    assert (
        amx_only.native_bf16
        and amx_only.best_isa() == "amx_bf16"
        and amx_only.cpu_layer_isa() == "avx2"
    )


def bf16_model(linear_backend: str = "auto") -> LeanDecoder:
    hf, _ = tiny_llama(0, layers=2)
    weights = {k: v.detach().to(torch.bfloat16) for k, v in hf.state_dict().items()}
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    return LeanDecoder(
        config, weights, kernel_backend="torch", linear_backend=linear_backend
    ).eval()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_bf16_target_loads_and_runs_under_each_kind(kind):
    """The decoder plans what the kind would run; where this machine cannot run it (the hardware
    check refuses the variant, oneDNN's trial reorder fails) it warns in one line and runs the
    fallback, whose logits match the dense bf16 path; the drafters' packed linears follow the same
    rule."""
    caps, variant, *_ = KINDS[kind]
    ids = torch.tensor([4, 8, 15, 16, 23])
    want = bf16_model("dense").forward(ids, bf16_model("dense").allocate_cache(8)).logits.float()
    runs_here = variant is not None and cpu_layer.why_unavailable(variant, caps=HARDWARE) is None
    with cpu_caps.injected(caps), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = bf16_model()
        linear = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False).bfloat16())
        packed = accelerate_linears(linear)
    if variant is None:
        assert model.linear_plan.kind == "dense" and packed == 0
    elif runs_here:
        assert model.linear_plan.label == f"cpp:{variant}" and packed == 1
    # the kind's variant cannot run on this CPU (or build here): refused, and the fallback runs
    else:
        assert model.linear_plan.kind in ("mkldnn", "dense") and packed == 0
        why = (
            "this machine's own CPU"
            if cpu_layer.why_unavailable(variant) is None
            else "fused layer unavailable"
        )
        assert any(why in str(w.message) for w in caught), [str(w.message) for w in caught]
    got = model.forward(ids, model.allocate_cache(8)).logits.float()
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)


def test_loading_a_variant_this_cpu_lacks_is_refused_even_under_injection():
    missing = [
        isa for isa in cpu_layer.ISAS if cpu_layer.why_unavailable(isa, caps=HARDWARE) is not None
    ]
    if not missing:
        pytest.skip(f"this CPU ({HARDWARE.best_isa()}) runs every variant")
    with cpu_caps.injected(KINDS["xeon_amx_fp16"][0]):
        assert cpu_layer.why_unavailable(
            missing[0]
        ) is None or "compiler" in cpu_layer.why_unavailable(missing[0])
        with pytest.raises(
            cpu_layer.CpuLayerUnavailable, match="lacks .*this machine's own CPU|compiler|ninja"
        ):
            cpu_layer.load_cpu_layer(missing[0])


NOT_RUNNABLE = [
    isa
    for isa in cpu_layer.ISAS
    if "lacks" in (cpu_layer.why_unavailable(isa, caps=HARDWARE) or "")
]


@pytest.mark.slow  # about a minute on a 2-core CPU the first time; remembered afterwards
@pytest.mark.parametrize(
    "isa",
    NOT_RUNNABLE
    or [pytest.param(None, marks=pytest.mark.skip("every variant runs (and builds) here"))],
)
def test_the_fused_variants_this_cpu_cannot_run_still_compile(isa):
    """A variant this CPU cannot run compiles on it (an object file, never imported or run; the
    variants it can run are built whenever the suite loads them), so a change to the AVX-512 branch
    is built on an AVX2 machine too.
    """
    if not HARDWARE.x86:
        pytest.skip("the fused layer's variants are x86 code")
    reason = cpu_layer.compile_check(isa)
    if reason is not None and "no C++ compiler" in reason:
        pytest.skip(reason)
    assert reason is None, reason
