"""The drafting path of ``common.layers.DraftAttention`` (no grad: SDPA's own GQA; no mask for one
query) gives the training path's output bits, so an export drafts what it was trained to draft."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from draftsmith.common.layers import DraftAttention, KVCache, build_attention_mask, rope_cos_sin

pytestmark = pytest.mark.unit


def _attention(kv_heads: int) -> DraftAttention:
    config = SimpleNamespace(
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=kv_heads,
        head_dim=8,
        rope_theta=10000.0,
    )
    torch.manual_seed(0)
    return DraftAttention(config, 48)


@pytest.mark.parametrize("kv_heads", [2, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafting_path_equals_the_training_path_bit_for_bit(kv_heads, dtype):
    attn = _attention(kv_heads).to(dtype)
    prefix = torch.randn(1, 11, 48, dtype=dtype)
    with torch.no_grad():
        _, cache = attn(prefix, torch.arange(11)[None], build_attention_mask(11, 0, prefix.device))
    assert isinstance(cache, KVCache) and cache.length == 11
    for new in (1, 3):
        x = torch.randn(1, new, 48, dtype=dtype)
        positions = torch.arange(11, 11 + new)[None]
        mask = build_attention_mask(new, 11, x.device)
        trained, _ = attn(x, positions, mask, cache)  # grad enabled: repeat_interleave + SDPA
        with torch.no_grad():
            drafted, grown = attn(x, positions, mask, cache)  # SDPA's GQA
            unmasked, _ = attn(x, positions, None, cache) if new == 1 else (drafted, None)
        assert grown.length == 11 + new
        assert torch.equal(trained.detach(), drafted) and torch.equal(drafted, unmasked)


def test_rope_tables_made_while_decoding_still_train():
    """The inverse-frequency table is cached; one first built under inference mode must not break a
    backward."""
    with torch.inference_mode():
        rope_cos_sin(torch.arange(4)[None], 8, 12345.0, torch.float32)
    attn = _attention(2)
    attn.config.head_dim, attn.config.rope_theta = 8, 12345.0
    x = torch.randn(1, 4, 48, requires_grad=True)
    out, _ = attn(x, torch.arange(4)[None], build_attention_mask(4, 0, x.device))
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
