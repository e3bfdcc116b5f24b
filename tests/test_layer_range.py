"""A layer-range forward on the lean decoder: layers a..b on the same cache, as a self-drafter
(Kangaroo) needs."""

import pytest
import torch
from test_runtime_model import tiny_model

from draftsmith.runtime.target.model import LeanDecoder

pytestmark = pytest.mark.unit


@pytest.fixture()
def model(tmp_path):
    tiny_model("Llama", tmp_path)
    return LeanDecoder.from_pretrained(tmp_path)


def test_layer_ranges_compose_to_the_whole_forward(model):
    ids = torch.tensor([5, 6, 7, 8, 9])
    want = model(ids, model.allocate_cache(8))
    want_logits, want_hidden = want.logits, want.hidden
    cache = model.allocate_cache(8)
    shallow = model.forward_layers(
        model.embed_tokens(ids), cache, 0, 1
    )  # [T, H]: a self-drafter's sub-network
    deep = model.forward_layers(shallow, cache, 1, model.config.num_layers)
    hidden = model.final_hidden(deep)
    torch.testing.assert_close(hidden, want_hidden)
    torch.testing.assert_close(model.lm_head_logits(hidden), want_logits)
    # The K/V each range wrote are the ones a full forward writes: the shallow cache is reusable as
    # is.
    full = model.allocate_cache(8)
    model(ids, full)
    for (k, v), (k_ref, v_ref) in zip(cache.layers, full.layers):
        torch.testing.assert_close(k[:, :5], k_ref[:, :5])
        torch.testing.assert_close(v[:, :5], v_ref[:, :5])


def test_layer_range_errors(model):
    cache = model.allocate_cache(4)
    x = model.embed_tokens(torch.tensor([5, 6]))
    with pytest.raises(ValueError, match="need 0 <= first < last"):
        model.forward_layers(x, cache, 2, 2)
    with pytest.raises(ValueError, match="hidden must be"):
        model.forward_layers(x[:, :3], cache, 0, 1)
