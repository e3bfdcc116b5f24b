"""The fused attention's rows shared out over threads (``kernels/cpu_decoder_layer.cpp``,
``layer_body``): past a few hundred slots each thread takes an equal share of the hkv x T x group
query rows, which can end inside a kv head's rows. Every row must stay what a one-token step and a
one-thread forward give, bit for bit."""

from __future__ import annotations

import pytest
import torch
from conftest import runnable_isas
from test_runtime_model import tiny_model

from draftsmith.kernels import cpu_layer
from draftsmith.runtime.target.model import LeanDecoder

RUNNABLE = runnable_isas()  # fixture `use_variant` in conftest.py
pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not RUNNABLE, reason=str(cpu_layer.why_unavailable())),
]


@pytest.mark.parametrize(
    "head_dim", [16, 48]
)  # V accumulators held 16 rows x 1 vector, 5 rows x 3 vectors
def test_attention_split_over_threads_keeps_rows_bit_for_bit(tmp_path, use_variant, head_dim):
    """Past a context of a few hundred slots the attention's query rows are shared out evenly over
    the threads: a share can end inside a kv head's rows (3 kv heads on 2 threads). Verify rows
    still equal the one-token steps and the one-thread forward bit for bit, with rows of the V pass
    in register blocks and alone."""
    tiny_model(
        "Llama",
        tmp_path,
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=head_dim,
        vocab_size=203,
    )
    model = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16, linear_backend="cpp")
    assert model._ops.layer is use_variant.decoder_layer and model._stack is not None
    gen = torch.Generator().manual_seed(5)
    prompt, new = (
        torch.randint(0, 203, (90,), generator=gen),
        torch.randint(0, 203, (16,), generator=gen),
    )
    threads = torch.get_num_threads()
    outputs = {}
    try:
        for nt in (2, 1):
            torch.set_num_threads(nt)
            one, batch = model.allocate_cache(110), model.allocate_cache(110)
            for cache in (one, batch):
                model(prompt, cache)
                cache.commit(90)
            rows = []
            for token in new:
                rows.append(model(token[None], one).logits)  # [1, V]
                one.commit(1)
            alone = torch.cat(rows)  # [16, V]
            for t in (5, 16):
                assert torch.equal(model(new[:t], batch).logits, alone[:t]), f"threads={nt} T={t}"
            outputs[nt] = alone
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[2], outputs[1])
