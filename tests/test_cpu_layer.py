"""The fused bf16 CPU layer (C++, AVX512-BF16) against the lean decoder's torch path, its reference."""

from __future__ import annotations

import pytest
import torch
from test_runtime_model import tiny_model

from draftsmith.kernels import cpu_layer
from draftsmith.runtime.autoregressive import generate_ar
from draftsmith.runtime.model import LeanDecoder

pytestmark = pytest.mark.skipif(cpu_layer.why_unavailable() is not None, reason=str(cpu_layer.why_unavailable()))


@pytest.fixture(scope="module")
def ext():
    return cpu_layer.load_cpu_layer()


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack_weight, written independently: element (r, k) sits at [r // 16, k // 2, (r % 16) * 2 + k % 2]."""
    blocks, pairs, _ = packed.shape
    rows = torch.arange(n)[:, None]
    cols = torch.arange(2 * pairs)[None, :]
    return packed[rows // 16, cols // 2, (rows % 16) * 2 + cols % 2]


@pytest.mark.parametrize("n", [37, 16 * 9 + 5])  # a lone partial block; four-block groups plus leftover blocks
def test_packed_linear_matches_matmul(ext, n):
    torch.manual_seed(0)
    w = torch.randn(n, 48).bfloat16()
    packed = cpu_layer.pack_weight(w)
    assert packed.shape == (-(-n // 16), 24, 32) and torch.equal(unpack(packed, n), w)
    bias = torch.randn(n).bfloat16()
    for t in (1, 2, 3, 4, 5, 9):  # every token-tile remainder
        x = torch.randn(t, 48).bfloat16()
        ref = (x.float() @ w.float().t() + bias.float()).bfloat16()
        got = ext.linear(x, packed, bias, n)
        assert got.shape == (t, n)
        torch.testing.assert_close(got.float(), ref.float(), atol=0.05, rtol=0.02)
        torch.testing.assert_close(ext.linear(x, packed, None, n).float(), (x.float() @ w.float().t()), atol=0.05,
                                   rtol=0.02)  # fmt: skip
    with pytest.raises(ValueError, match="even number"):
        cpu_layer.pack_weight(torch.zeros(4, 3).bfloat16())
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        ext.linear(torch.randn(2, 48), packed, None, n)  # fp32 input
    with pytest.raises(RuntimeError, match="do not match"):
        ext.linear(torch.randn(2, 46).bfloat16(), packed, None, n)


def close_as_bf16_reference(got: torch.Tensor, ref_bf16: torch.Tensor, ref_f32: torch.Tensor, what: str) -> None:
    """``got`` is at most three times as far from the fp32 result as the torch path's bf16 result is (plus 1e-3)."""
    budget = 3 * (ref_bf16.float() - ref_f32).abs().max().item() + 1e-3
    err = (got.float() - ref_f32).abs().max().item()
    assert err <= budget, f"{what}: fused error {err:.4g} exceeds {budget:.4g} (torch bf16 path x3)"


@pytest.mark.parametrize("kind", ["Llama", "Qwen2", "Qwen3"])  # plain; q/k/v biases; per-head q/k norm
def test_fused_layer_matches_torch_path(tmp_path, ext, kind):
    """Prefill, a tree-masked forward at tree positions and a one-token step: logits, hidden states and the K/V
    written to the cache are as close to fp32 as the torch path's bf16 results are (errors here are ~4e-3 on
    logits of ~0.5, so a 10% slip in RoPE or a dropped bias fails)."""
    extra = {"head_dim": 16} if kind == "Qwen3" else {}
    tiny_model(kind, tmp_path, **extra)
    models = [LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend=b) for b in ("dense", "cpp")]
    models.append(LeanDecoder.from_pretrained(tmp_path, dtype=torch.float32))
    caches = [m.allocate_cache(32) for m in models]
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    steps = [
        dict(input_ids=torch.tensor([5, 9, 2, 7, 11, 3, 8])),  # causal prefill
        dict(input_ids=torch.tensor([4, 6, 12, 1]), tree_mask=tree, positions=torch.tensor([7, 8, 8, 9])),
        dict(input_ids=torch.tensor([10])),
    ]
    for step in steps:
        (ref, ref_h), (got, got_h), (f32, f32_h) = (m(cache=c, **step) for m, c in zip(models, caches))
        close_as_bf16_reference(got, ref, f32, "logits")
        close_as_bf16_reference(got_h, ref_h, f32_h, "hidden")
        start, end = caches[0].length, caches[0].length + step["input_ids"].numel()
        for name in ("k", "v"):
            ref_kv, got_kv, f32_kv = (getattr(c, name)[:, :, start:end] for c in caches)
            close_as_bf16_reference(got_kv, ref_kv, f32_kv, name)
        for cache in caches:
            cache.commit(end - start)


def test_fused_layer_greedy_decoding_and_taps(tmp_path, ext):
    """Greedy decoding through the fused layer follows the torch path's tokens; layer taps are the layer inputs."""
    tiny_model("Llama", tmp_path)
    ref = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend="dense")
    fused = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend="cpp")
    assert generate_ar(fused, [1, 2, 3], 16) == generate_ar(ref, [1, 2, 3], 16)
    ids = torch.tensor([3, 4, 5])
    _, _, taps_ref = ref.forward_taps(ids, ref.allocate_cache(8), taps=(0, 1, 2))
    _, _, taps_got = fused.forward_taps(ids, fused.allocate_cache(8), taps=(0, 1, 2))
    assert sorted(taps_got) == [0, 1, 2]
    assert torch.equal(taps_got[0], taps_ref[0])  # the embeddings themselves
    for i in (1, 2):
        torch.testing.assert_close(taps_got[i].float(), taps_ref[i].float(), atol=0.05, rtol=0.05)


def test_cpp_backend_errors_name_the_reason(tmp_path):
    tiny_model("Llama", tmp_path)
    with pytest.raises(ValueError, match="needs bf16 weights on CPU"):
        LeanDecoder.from_pretrained(tmp_path, linear_backend="cpp")  # fp32
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        LeanDecoder.from_pretrained(tmp_path, linear_backend="fast")
    assert "head_dim 24" in cpu_layer.shapes_supported(24, 64, 96)


def test_accelerate_linears_swaps_bf16_cpu_linears_only(ext):
    from draftsmith.runtime.fast_linear import PackedLinear, accelerate_linears

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 40), torch.nn.SiLU(), torch.nn.Linear(40, 7, bias=False))
    x = torch.randn(3, 5, 32)
    want = net.bfloat16()(x.bfloat16())
    assert accelerate_linears(net) == 2 and all(isinstance(net[i], PackedLinear) for i in (0, 2))
    got = net(x.bfloat16())
    assert got.shape == (3, 5, 7) and net[0].weight.dtype == torch.bfloat16  # .weight stays readable
    torch.testing.assert_close(got.float(), want.float(), atol=0.03, rtol=0.02)
    assert accelerate_linears(torch.nn.Sequential(torch.nn.Linear(8, 8))) == 0  # fp32 stays as it is
