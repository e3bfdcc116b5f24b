"""The lean decoder on every family it serves, against transformers on tiny random models (fp32):
prefill, cached decode steps and a tree-masked forward at contexts longer than the sliding window;
speculative output identical to greedy; the config reading of each family; what goes to the
fallback."""

from __future__ import annotations

import pytest
import torch
import transformers
from test_runtime_model import path_to, tree_case  # the same 7-node tree for every family

from draftsmith.kernels import cpu_caps
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.chain import ChainProposer, DecoderDrafter, SampledTreeProposer
from draftsmith.runtime.target.family_decoder import FamilyDecoder
from draftsmith.runtime.target.linear_ops import plan_linear_backend
from draftsmith.runtime.target.loading import load_decoder
from draftsmith.runtime.target.model import LeanDecoder, UnsupportedArchitecture
from draftsmith.runtime.target.model_config import ModelConfig, lean_support

pytestmark = pytest.mark.unit

VOCAB, WINDOW = 96, 6
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
}
# name -> (HF class prefix, config overrides); every windowed one has WINDOW, far shorter than the
# contexts below
FAMILIES = {
    "mistral_window": ("Mistral", {"sliding_window": WINDOW}),
    "qwen2_bias": ("Qwen2", {}),
    "qwen2_window_layers": (
        "Qwen2",
        {
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 1,
            "num_hidden_layers": 3,
        },
    ),
    "qwen3_qknorm": ("Qwen3", {"head_dim": 16}),
    "llama3_rope": ("Llama", {"rope_scaling": LLAMA3_ROPE, "attention_bias": True}),
    "phi3": ("Phi3", {}),
    "phi3_window": ("Phi3", {"sliding_window": WINDOW}),
    "gemma2": (
        "Gemma2",
        {
            "sliding_window": WINDOW,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 0.5,
            "final_logit_softcapping": 2.0,
        },
    ),
    "gemma3": (
        "Gemma3Text",
        {
            "sliding_window": WINDOW,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "rope_parameters": GEMMA3_ROPE,
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
            ],
        },
    ),
}


def build(kind: str, folder, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A random tiny HF model (GQA 4/2 heads, eager attention) with non-trivial norms and biases,
    saved to folder."""
    torch.manual_seed(seed)
    kw = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    kw.update(overrides)
    config = getattr(transformers, f"{kind}Config")(**kw)
    config._attn_implementation = "eager"  # Gemma-2's softcap is applied by the eager path only
    cls = (
        transformers.Gemma3ForCausalLM
        if kind == "Gemma3Text"
        else getattr(transformers, f"{kind}ForCausalLM")
    )
    model = cls(config).eval()
    # default init makes norms 1 (Gemma: 0) and biases 0, which would hide wiring mistakes
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif "bias" in name:
                p.normal_(0.0, 0.2)
        model.lm_head.weight.mul_(4.0)  # sharper logits: greedy ties are out of the question
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    kind, overrides = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = build(kind, folder, **overrides)
    return request.param, hf, load_decoder(folder, backend="lean", kernel_backend="torch")


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, V]


def test_prefill_decode_and_tree_match_hf_past_the_window(family):
    name, hf, lean = family
    windowed = any(w is not None for w in lean.config.layer_windows)
    assert isinstance(lean, FamilyDecoder) == (lean.config.llama_layer_gap is not None)
    assert windowed == (
        name.endswith("window") or name.endswith("window_layers") or name.startswith("gemma")
    )
    ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = lean.allocate_cache(40)  # far longer than the window
    steps = [lean(torch.tensor(ids[:11]), cache).logits]
    cache.commit(11)
    for tok in ids[11:]:  # cached decode steps, each past the window
        steps.append(lean(torch.tensor([tok]), cache, logits_for="last").logits)
        cache.commit(1)
    torch.testing.assert_close(torch.cat(steps), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
    parents, mask, depth = tree_case()
    tokens = [11, 23, 7, 64, 2, 90, 31]
    res = lean(torch.tensor(tokens), cache, tree_mask=mask, positions=len(ids) + depth)
    for node in range(len(tokens)):
        path = [tokens[j] for j in path_to(parents, node)]
        torch.testing.assert_close(
            res.logits[node], hf_logits(hf, ids + path)[-1], atol=1e-4, rtol=1e-4
        )


def test_speculative_output_is_greedy_past_the_window(family):
    _, hf, lean = family
    prompt, new = [5, 17, 40, 3, 42, 8, 19, 77, 60, 2], 30
    ref = list(prompt)
    for _ in range(new):  # greedy by transformers' full-sequence forward
        ref.append(int(hf_logits(hf, ref)[-1].argmax()))
    inner = DecoderDrafter(lean, 128)

    def noisy(
        ids,
    ):  # the target itself, deterministically wrong every third length: some drafts are rejected
        logits = inner(ids)
        return logits.roll(1) if len(ids) % 3 == 0 else logits

    chain = SpeculativeDecoder(lean, ChainProposer(noisy, depth=3)).generate(prompt, new)
    assert chain.tokens == ref[len(prompt) :] and chain.tau > 1.2
    tree = SpeculativeDecoder(
        lean, SampledTreeProposer(noisy, (2, 2, 1), temperature=0.0)
    ).generate(prompt, new)
    assert tree.tokens == ref[len(prompt) :]


def test_taps_and_layer_ranges_match_a_whole_forward(family):
    _, hf, lean = family
    ids = torch.arange(3, 17)
    whole = lean(ids, lean.allocate_cache(16), taps=(1,))
    cache = lean.allocate_cache(16)
    with torch.inference_mode():
        x = lean.forward_layers(lean.embed_tokens(ids), cache, 0, 1)
        torch.testing.assert_close(x, whole.taps[1], atol=1e-5, rtol=1e-5)
        x = lean.forward_layers(x, cache, 1, lean.config.num_layers)
        torch.testing.assert_close(
            lean.lm_head_logits(lean.final_hidden(x)), whole.logits, atol=1e-4, rtol=1e-4
        )
    with torch.no_grad():
        torch.testing.assert_close(
            whole.taps[1],
            hf(ids[None], output_hidden_states=True).hidden_states[1][0],
            atol=1e-4,
            rtol=1e-4,
        )


def test_llama_family_stays_on_the_plain_layer(tmp_path):
    build("Llama", tmp_path / "l")
    build(
        "Mistral", tmp_path / "m", sliding_window=4096
    )  # a window past max_position_embeddings never masks
    build("Phi3", tmp_path / "p")
    for sub in ("l", "m", "p"):
        lean = LeanDecoder.from_pretrained(tmp_path / sub)
        assert type(lean) is LeanDecoder and lean.config.llama_layer_gap is None
    with pytest.raises(UnsupportedArchitecture, match="sliding window"):
        LeanDecoder.from_pretrained(tmp_path / "m").allocate_cache(5000)


def test_the_fused_cpp_layer_is_never_planned_for_a_family_it_lacks(tmp_path):
    zen4 = cpu_caps.CpuCaps(
        "x86_64",
        frozenset("avx avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16".split()),
        "AMD EPYC 9004",
    )
    sizes = (16, 64, 96)
    assert (
        plan_linear_backend("auto", torch.bfloat16, "cpu", sizes, caps=zen4, mkldnn_ok=True).kind
        == "cpp"
    )
    gap = "the fused C++ layer lacks sliding-window attention"
    plan = plan_linear_backend(
        "auto", torch.bfloat16, "cpu", sizes, caps=zen4, mkldnn_ok=True, unfused=gap
    )
    assert plan.kind == "mkldnn" and gap in plan.reason
    with pytest.raises(
        ValueError, match="cpp' cannot run: the fused C\\+\\+ layer lacks sliding-window"
    ):
        plan_linear_backend(
            "cpp", torch.bfloat16, "cpu", sizes, caps=zen4, mkldnn_ok=True, unfused=gap
        )
    hf = build("Gemma2", tmp_path, sliding_window=WINDOW, head_dim=16)
    with pytest.warns(
        UserWarning, match="fused layer unavailable"
    ):  # bf16 on CPU: says why it is not fused
        lean = LeanDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert lean.linear_plan.kind != "cpp"
    ids = list(range(3, 20))
    cache = lean.allocate_cache(24)
    got = lean(torch.tensor(ids), cache).logits.float()
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=0.15, rtol=0.05)  # bf16 against fp32


def test_configs_are_read_as_transformers_reads_them():
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_hidden_layers=7,
    )
    gemma3_v4 = ModelConfig.from_hf_dict(
        {
            **base,
            "model_type": "gemma3_text",
            "sliding_window": 512,
            "sliding_window_pattern": 3,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "max_position_embeddings": 32768,
        }
    )
    assert gemma3_v4.layer_windows == (512, 512, None, 512, 512, None, 512)
    assert (gemma3_v4.rope_theta, gemma3_v4.rope_type, gemma3_v4.local_rope_theta) == (
        1e6,
        "linear",
        1e4,
    )
    assert gemma3_v4.tie_word_embeddings and gemma3_v4.qk_norm and gemma3_v4.attn_softcap is None
    gemma2 = ModelConfig.from_hf_dict(
        {**base, "model_type": "gemma2", "max_position_embeddings": 8192}
    )
    assert gemma2.layer_windows == (4096, None) * 3 + (4096,)
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.attn_scale) == (50.0, 30.0, 256**-0.5)
    assert gemma2.hidden_act == "gelu_pytorch_tanh" and gemma2.embed_scale == 8.0
    qwen = ModelConfig.from_hf_dict(
        {
            **base,
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 64,
            "max_window_layers": 5,
        }
    )
    assert qwen.layer_windows == (None,) * 5 + (64, 64)
    off = ModelConfig.from_hf_dict(
        {**base, "model_type": "qwen2", "sliding_window": 64, "max_window_layers": 5}
    )
    assert off.layer_windows == (None,) * 7 and off.llama_layer_gap is None


def test_lean_support_names_what_goes_to_the_fallback():
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_hidden_layers=2,
    )
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"):
        assert lean_support({**base, "model_type": model_type}) is None
    assert lean_support({**base, "model_type": "gpt2"}) == "model_type 'gpt2'"
    # multimodal wrapper
    assert lean_support({**base, "model_type": "gemma3"}) == "model_type 'gemma3'"
    assert (
        lean_support({**base, "model_type": "llama", "rope_scaling": {"rope_type": "yarn"}})
        == "rope type 'yarn'"
    )
    assert (
        lean_support({**base, "model_type": "phi3", "rope_scaling": {"type": "longrope"}})
        == "rope type 'longrope'"
    )
    assert "partial rotary" in lean_support(
        {**base, "model_type": "phi3", "partial_rotary_factor": 0.75}
    )
    assert (
        lean_support({**base, "model_type": "llama", "hidden_act": "relu"}) == "hidden_act 'relu'"
    )
    assert "bidirectional" in lean_support(
        {**base, "model_type": "gemma3_text", "use_bidirectional_attention": True}
    )
    assert "incomplete" in lean_support({"model_type": "llama"})
    with pytest.raises(UnsupportedArchitecture, match="model_type 'gpt2'.*backend='hf'"):
        ModelConfig.from_hf_dict({**base, "model_type": "gpt2"})
