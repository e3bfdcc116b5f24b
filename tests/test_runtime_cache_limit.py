"""The speculative KV cache is sized from the model and the request, and the loop refuses exactly
what the CLI's up-front prompt check refuses (issue 40: a 4,300-token prompt ran in plain decoding
and failed with a drafter, whose cache was capped at 4,096 slots while the check allowed 8,191
tokens)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_llama
from runtime_exports import medusa_export_for

from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.prompt_limits import check_prompt_fits, context_limit
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.chain import ChainProposer, DecoderDrafter

pytestmark = pytest.mark.unit


def test_a_prompt_past_4096_tokens_serves_with_a_drafter_as_it_does_without(
    tmp_path, tiny_tokenizer
):
    from draftsmith.runtime.serving import load_runtime

    folder = tmp_path / "long_target"
    build_tiny_llama(
        len(tiny_tokenizer), num_hidden_layers=1, max_position_embeddings=8192
    ).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    rt = load_runtime(
        str(medusa_export_for(folder, tiny_tokenizer, tmp_path / "export")[0]), None, "fp32"
    )
    assert rt.speculative.max_cache_len is None  # no fixed cap: sized from each request
    # 4,100 tokens + 4 new + a 6-node tree: past the old 4,096 slots, well inside the target's 8,192
    # positions
    prompt = torch.randint(
        5, len(tiny_tokenizer), (4100,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    check_prompt_fits(
        len(prompt), context_limit(rt.model), "the prompt"
    )  # what `generate` checks up front
    got = rt.speculative.generate(prompt, 4, eos_ids=())
    assert got.tokens == generate_ar(rt.model, prompt, 4) and got.steps >= 1


def test_the_loop_and_the_up_front_check_agree_at_the_context_edge(tiny_target_dir):
    from draftsmith.runtime.target.loading import load_decoder

    model = load_decoder(tiny_target_dir, kernel_backend="torch")  # max_position_embeddings = 512
    limit = context_limit(model)
    drafter = ChainProposer(DecoderDrafter(model, 1024), depth=3)
    longest = [
        (7 * i) % 90 + 5 for i in range(limit - 1)
    ]  # the longest prompt the check lets through
    check_prompt_fits(len(longest), limit, "the prompt")
    spec = SpeculativeDecoder(model, drafter)
    assert spec.generate(longest, 3).tokens == generate_ar(model, longest, 3)
    too_long = [*longest, 9]
    with pytest.raises(ValueError) as up_front:
        check_prompt_fits(len(too_long), limit, "the prompt")
    with pytest.raises(ValueError) as in_loop:
        spec.generate(too_long, 3)
    assert str(in_loop.value) == str(up_front.value) and "at most 511 tokens" in str(in_loop.value)
    capped = SpeculativeDecoder(
        model, drafter, max_cache_len=64
    )  # an explicit cap still holds, and says so
    with pytest.raises(
        ValueError, match=r"need 75 cache slots but the limit is 64 \(max_cache_len\)"
    ):
        capped.generate(longest[:50], 21)
