"""The EAGLE-3 draft step served near its floor: the static draft KV cache against the immutable
one, the serving step against the drafter's own draft step, grouped attention against SDPA, and the
native bf16 draft layer (values and lossless greedy output)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_speculative import plain_greedy, tiny_llama
from test_verify_floor import bf16_decoder

from draftsmith.common.layers import KVCache
from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from draftsmith.kernels import cpu_layer
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting import eagle_native
from draftsmith.runtime.drafting.eagle_adapters import Eagle3DraftModel
from draftsmith.runtime.drafting.eagle_ops import StaticDraftKV, grouped_attention
from draftsmith.runtime.drafting.eagle_proposer import EagleProposer

pytestmark = pytest.mark.unit

RUNNABLE = [isa for isa in cpu_layer.ISAS if cpu_layer.why_unavailable(isa) is None]
needs_cpp = pytest.mark.skipif(not RUNNABLE, reason=str(cpu_layer.why_unavailable()))


def test_static_draft_kv_length_counter_matches_the_cat_version():
    g = torch.Generator().manual_seed(0)
    entries = [torch.randn(1, 2, s, 8, generator=g) for s in (5, 1, 3, 1, 1, 4)]
    static = StaticDraftKV(entries[0][:, :, :0], capacity=4)  # small: it has to grow twice
    immutable = None
    for i, e in enumerate(entries):
        static = static.append(e, -e)
        immutable = KVCache(e, -e) if immutable is None else immutable.append(e, -e)
        assert static.length == immutable.length
        assert torch.equal(static.key, immutable.key) and torch.equal(static.value, immutable.value)
        if i == 2:  # a crop drops the speculative entries; the next append overwrites them
            static, immutable = static.crop(5), immutable.crop(5)
    assert static.capacity >= static.length > 4
    with pytest.raises(ValueError, match="cannot crop"):
        static.crop(static.length + 1)


def compare_steps(step, ref_step, hidden: int, dtype: torch.dtype, tol: dict, features) -> None:
    """Run ``step`` and ``ref_step`` (both ``(hidden, ids, cache, positions, mask) -> (out, logits,
    cache)``) over a root step, a chain step, a crop and a tree step whose frontier nodes see
    neither each other nor one earlier entry; outputs, logits and caches must agree within
    ``tol``."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (1, 6), generator=g)
    tree = torch.ones(3, 9, dtype=torch.bool)
    tree[0, 7:] = tree[1, 6] = tree[2, 6:8] = False
    calls = [
        (features(torch.randn(6, 2 * hidden, generator=g).to(dtype)), ids, None, None),
        (torch.randn(1, 1, hidden, generator=g).to(dtype), ids[:, :1], None, None),
        "crop",
        (torch.randn(1, 3, hidden, generator=g).to(dtype), ids[:, :3], torch.full((1, 3), 6), tree),
    ]
    mine = ref = None
    with torch.no_grad():
        for call in calls:
            if call == "crop":
                mine, ref = mine.crop(6), ref.crop(6)
                continue
            got, want = step(*call[:2], mine, *call[2:]), ref_step(*call[:2], ref, *call[2:])
            mine, ref = got[2], want[2]
            for a, b in (
                (got[0], want[0]),
                (got[1], want[1]),
                (mine.key, ref.key),
                (mine.value, ref.value),
            ):
                torch.testing.assert_close(a.float(), b.float(), **tol)
    assert isinstance(mine, StaticDraftKV) and mine.length == ref.length == 9


def test_eagle3_serving_step_equals_the_drafters_own_draft_step():
    """The runtime step (fused q/k/v and gate/up, RoPE tables, static KV) gives the drafter's
    draft_step outputs."""
    torch.manual_seed(0)
    cfg = Eagle3Config(
        hidden_size=32,
        vocab_size=50,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        draft_vocab_size=50,
        target_layers=(0, 1),
    )
    drafter = Eagle3Drafter(cfg, torch.randn(50, 32)).eval()
    model = Eagle3DraftModel(drafter)
    compare_steps(
        lambda h, i, c, p, m: model.step(h, i, c, p, m, last_only=False),
        lambda h, i, c, p, m: drafter.draft_step(h, i, c, p, tree_mask=m),
        32,
        torch.float32,
        {"atol": 1e-5, "rtol": 1e-5},
        model.features,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq", [1, 4])
def test_grouped_attention_equals_sdpa_with_gqa(dtype, seq):
    g = torch.Generator().manual_seed(seq)
    store = torch.randn(1, 2, 64, 16, generator=g).to(
        dtype
    )  # a static cache's storage: the keys are a strided view
    key, value = store[:, :, :40], store[:, :, 10:50]
    q = torch.randn(1, 6, seq, 16, generator=g).to(dtype)
    mask = (
        None
        if seq == 1
        else (torch.rand(1, 1, seq, 40, generator=g) > 0.4) | (torch.arange(40) == 39)
    )
    got = grouped_attention(q, key, value, mask)  # every query sees at least its last key
    want = F.scaled_dot_product_attention(
        q.float(), key.float(), value.float(), attn_mask=mask, enable_gqa=True
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and got.shape == (1, 6, seq, 16)
    torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=tol, rtol=tol)


def bf16_eagle3(hidden: int = 64, vocab: int = 1003, seed: int = 0) -> Eagle3Drafter:
    """A random EAGLE-3 drafter in bf16 with shapes the fused layer takes (head_dim 16)."""
    torch.manual_seed(seed)
    cfg = Eagle3Config(
        hidden_size=hidden,
        vocab_size=vocab,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        draft_vocab_size=vocab,
        target_layers=(0, 1),
    )
    drafter = Eagle3Drafter(cfg, torch.randn(vocab, hidden))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)  # not all ones: a wiring mistake must show
    return drafter.to(torch.bfloat16).eval()


@needs_cpp
def test_native_eagle3_layer_matches_the_torch_step(monkeypatch):
    """The fused C++ draft layer against the torch step, to bf16 rounding."""
    drafter = bf16_eagle3()
    native = Eagle3DraftModel(drafter)
    assert native.fused_reason is None and native._kernel is not None
    monkeypatch.setattr(eagle_native, "draft_kernel", lambda d: (None, "forced off"))
    torch_path = Eagle3DraftModel(drafter)
    assert torch_path.fused_reason == "forced off"
    compare_steps(
        lambda h, i, c, p, m: native.step(h, i, c, p, m, last_only=False),
        lambda h, i, c, p, m: torch_path.step(h, i, c, p, m, last_only=False),
        64,
        torch.bfloat16,
        {"atol": 0.1, "rtol": 0.05},
        native.features,
    )


@needs_cpp
def test_greedy_eagle3_with_the_native_draft_layer_is_lossless():
    """bf16 target through the fused layer, EAGLE-3 drafting through the native draft layer, greedy
    verification through the argmax head: the tokens are plain greedy's, for chains and dynamic
    trees."""
    hf, _ = tiny_llama(0, vocab=1003, head_scale=8.0)
    target = bf16_decoder(hf, "cpp")
    prompt, new = [1, 5, 9, 300, 7], 32
    reference = plain_greedy(target, prompt, new)
    drafter = bf16_eagle3()
    drafter.embed_weight.copy_(target.embed_weight)
    for options in (
        {"policy": "chain", "depth": 3},
        {"policy": "tree", "total_tokens": 8, "depth": 3, "top_k": 2},
    ):
        proposer = EagleProposer(Eagle3DraftModel(drafter), **options)
        assert proposer.model.fused_reason is None
        res = SpeculativeDecoder(target, proposer).generate(prompt, new)
        assert res.tokens == reference
