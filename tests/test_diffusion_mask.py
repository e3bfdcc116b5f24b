"""The block-diffusion attention trap: bidirectional inside a block, causal across blocks (tiny
Llama, no hub)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_llama

from draftsmith.runtime.target.diffusion_lm import (
    DiffusionLM,
    DiffusionSpec,
    DiffusionTargetError,
    block_ids,
    spec_of,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_future_token_changes_earlier_position_inside_block_only(attn):
    model = build_tiny_llama(50, attn_implementation=attn)
    lm = DiffusionLM(model, None, DiffusionSpec(block_length=4, mask_token_id=49))
    ids = torch.randint(5, 40, (1, 12), generator=torch.Generator().manual_seed(0))
    blocks = block_ids(12, 4)[None]  # blocks 0..2 of 4 positions
    base, _ = lm.forward(ids, blocks)
    changed = ids.clone()
    changed[0, 6] = 41  # position 6 sits in block 1 (positions 4..7)
    other, _ = lm.forward(changed, blocks)
    diff = (base - other).abs().amax(-1)[0]  # [T]
    # earlier positions of the same block see the future token
    assert diff[4] > 1e-4 and diff[5] > 1e-4
    assert torch.all(diff[:4] == 0)  # an earlier block never does
    # The plain (causal) forward would leave positions 4 and 5 unchanged: the trap this guards
    # against.
    plain = (model(ids).logits - model(changed).logits).abs().amax(-1)[0]
    assert torch.all(plain[:6] == 0)


def test_prefix_cache_matches_full_forward():
    model = build_tiny_llama(50)
    lm = DiffusionLM(model, None, DiffusionSpec(block_length=4, mask_token_id=49))
    ids = torch.randint(5, 40, (1, 12), generator=torch.Generator().manual_seed(1))
    blocks = block_ids(12, 4)[None]
    full, _ = lm.forward(ids, blocks)
    _, cache = lm.forward(ids[:, :8], blocks[:, :8], commit=True)
    tail, cache_after = lm.forward(ids[:, 8:], blocks[:, 8:], cache, past_blocks=blocks[:, :8])
    assert cache_after.get_seq_length() == 8  # scoring a block never commits it
    torch.testing.assert_close(tail, full[:, 8:], atol=1e-5, rtol=1e-4)


def test_causal_model_is_refused_as_diffusion_target(tiny_target_dir):
    from draftsmith.runtime.target.diffusion_lm import load_diffusion_lm

    with pytest.raises(DiffusionTargetError, match="causal .*not a block-diffusion target"):
        load_diffusion_lm(str(tiny_target_dir))
    with pytest.raises(DiffusionTargetError, match="recipe=diffusion_adapt"):
        spec_of({"model_type": "llama"})
