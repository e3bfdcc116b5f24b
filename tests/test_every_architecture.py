"""Models users bring (tiny random configs of 15 architectures, built in-process): the loader serves
each on the backend it should, plain greedy decoding equals HF ``generate``, the oracle proposer
(acceptance 0.8, chain 4) is lossless 160 tokens past a sliding window of 16, and the EAGLE family
sizes itself from each config.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from architectures import ARCHITECTURES, WINDOW, greedy_generate, save_tiny, tiny_model

from draftsmith.bench.oracle import CHECK_CHAIN, oracle_lossless
from draftsmith.common.hf_forward import BackboneNotRun, backbone, hf_forward
from draftsmith.drafters.eagle import EagleConfig, mlp_width
from draftsmith.drafters.eagle3 import Eagle3Config
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.target.hf import HFModelAdapter
from draftsmith.runtime.target.loading import choose_decoder

pytestmark = pytest.mark.unit

PROMPT, NEW = (
    [
        5,
        17,
        3,
        42,
        8,
        61,
        29,
        11,
    ],
    160,
)  # 168 positions: past the window of 16 ten times over


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_architecture_is_served_and_the_oracle_is_lossless_past_the_window(name, tmp_path):
    backend = ARCHITECTURES[name][0]
    hf = save_tiny(name, tmp_path)
    decoder, chosen, why = choose_decoder(tmp_path, kernel_backend="torch")
    assert chosen == backend, why
    want = greedy_generate(hf, PROMPT, NEW)
    assert generate_ar(decoder, PROMPT, NEW) == want
    check = oracle_lossless(decoder, (), [PROMPT], NEW, [want], kernels="torch")
    assert check["all_identical"], (name, check["first_mismatch"])
    # drafts were accepted on most steps
    assert check["tau"] > 2.5 and check["chain"] == CHECK_CHAIN
    assert WINDOW < len(PROMPT) + NEW


def test_opt_is_served_through_the_module_its_forward_runs():
    """OPTForCausalLM.forward calls ``self.model.decoder``, not ``self.model``: the fallback hooks
    the decoder, so its hidden states and taps are the model's own (hooking ``model.model`` never
    fired: "list index out of range").
    """
    opt = tiny_model("opt")
    assert backbone(opt) is opt.model.decoder
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        own = opt(ids, output_hidden_states=True)
    out, logits = hf_forward(opt, None, 0, input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(logits, own.logits)
    torch.testing.assert_close(out.hidden_states[1], own.hidden_states[1])
    with pytest.raises(BackboneNotRun, match="never ran OPTModel"):
        hf_forward(opt, opt.model, 0, input_ids=ids)
    adapter = HFModelAdapter(opt)
    res = adapter.forward(torch.tensor(PROMPT), adapter.allocate_cache(16), taps=(1,))
    torch.testing.assert_close(res.taps[1], own.hidden_states[1][0])


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_the_eagle_family_sizes_itself_from_every_config(name):
    config = tiny_model(name).config
    dims = EagleConfig.dims_from_hf(config)
    expected_mlp = {"gpt2": 4 * 64, "opt": 128, "falcon": 4 * 64}.get(
        name, 128
    )  # GPT-2 n_inner=None: 4 x hidden
    assert dims["intermediate_size"] == mlp_width(config) == expected_mlp
    assert (
        dims["hidden_size"] == 64 and dims["vocab_size"] == 96 and dims["num_attention_heads"] == 4
    )
    assert (
        dims["num_attention_heads"] % dims["num_key_value_heads"] == 0 and dims["head_dim"] % 2 == 0
    )
    EagleConfig(**dims)  # both drafters accept the sizes
    Eagle3Config(**dims, draft_vocab_size=32, target_layers=(0, 1))


@pytest.mark.parametrize("name", ["gpt_neox", "opt", "falcon"])
def test_the_fallback_passes_its_cache_by_the_name_transformers_keeps(name):
    """transformers 5 renamed the KV cache argument (``past_key_values`` is deprecated, gone in
    5.40): the fallback's cached decode steps raise no deprecation warning, and still equal the
    uncached forward."""
    model = tiny_model(name)
    adapter = HFModelAdapter(model)
    cache = adapter.allocate_cache(32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adapter.forward(torch.tensor(PROMPT), cache, logits_for="last")
        cache.commit(len(PROMPT))
        step = adapter.forward(torch.tensor([7]), cache, logits_for="last").logits[0]
    assert not [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    with torch.no_grad():
        torch.testing.assert_close(
            step, model(torch.tensor([PROMPT + [7]])).logits[0, -1], atol=1e-5, rtol=1e-5
        )
