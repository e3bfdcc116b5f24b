"""The transformers fallback serves speculative decoding losslessly or refuses at load, per family;
`--backend`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as tf

from draftsmith import cli
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.chain import SampledTreeProposer
from draftsmith.runtime.target.hf import HFModelAdapter, probe_trees
from draftsmith.runtime.target.loading import choose_decoder
from draftsmith.runtime.target.model_config import UnsupportedArchitecture

pytestmark = pytest.mark.unit

VOCAB, WINDOW = 96, 6
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
SLIDING_FIRST = ["sliding_attention", "sliding_attention", "full_attention"]


def tiny(family: str, vocab: int = VOCAB, **extra) -> torch.nn.Module:
    """A random tiny model of ``family`` in fp32; windowed families get a window of WINDOW
    tokens."""
    torch.manual_seed(0)
    common = {**COMMON, "vocab_size": vocab, **extra}
    gemma = dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=WINDOW)
    qwen = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    build = {
        "gemma2": lambda: tf.Gemma2ForCausalLM(
            tf.Gemma2Config(**common, **gemma)
        ),  # softcaps on by default
        "gemma3": lambda: tf.Gemma3ForCausalLM(
            tf.Gemma3TextConfig(**common, **gemma, layer_types=SLIDING_FIRST)
        ),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=WINDOW)),
        "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**common, sliding_window=WINDOW)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, **qwen)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, **qwen)),
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common)),
        "gpt2": lambda: tf.GPT2LMHeadModel(
            tf.GPT2Config(
                n_embd=32,
                n_layer=2,
                n_head=2,
                vocab_size=vocab,
                n_positions=256,
                eos_token_id=1,
                bos_token_id=2,
            )
        ),
    }
    return build[family]().eval()


def plain_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by the model's own uncached forward over the whole sequence: the
    reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def noisy_drafter(model: torch.nn.Module, scale: float = 0.5):
    """The model's own next-token logits plus noise: mostly right, sometimes rejected (exercises
    crop + compact)."""
    g = torch.Generator().manual_seed(3)

    def draft(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = model(ids.cpu()[None]).logits[0, -1]  # [V]
        return logits + scale * logits.std() * torch.randn(logits.shape, generator=g)

    return draft


@pytest.mark.parametrize(
    "family", ["gemma2", "gemma3", "mistral", "phi3", "qwen2", "qwen3", "llama", "gpt2"]
)
def test_fallback_trees_are_lossless_past_the_window(family):
    """Speculative greedy == plain greedy token by token at contexts several windows long, with tree
    drafts."""
    model = tiny(family)
    adapter = HFModelAdapter(model)
    adapter.check_speculative()  # served: nothing refused
    assert adapter.tree_refusal is None
    windowed = family not in ("llama", "gpt2")
    assert bool(adapter.attention.windows) == windowed
    prompt = torch.randint(3, VOCAB, (10,), generator=torch.Generator().manual_seed(7)).tolist()
    want = plain_greedy(model, prompt, 24)  # 34 positions: over five windows
    spec = SpeculativeDecoder(
        adapter, SampledTreeProposer(noisy_drafter(model), (2, 2, 1), temperature=0.0)
    )
    result = spec.generate(prompt, 24)
    assert result.tokens == want
    assert result.steps < 24  # drafts were accepted: the tree path ran, not one token per step
    assert generate_ar(adapter, prompt, 24) == want  # plain AR through the fallback too


@pytest.mark.parametrize("family", ["gemma2", "mistral", "qwen2"])
def test_the_probe_catches_a_mask_that_drops_the_window(family):
    """The old fallback (tree mask without the window) is what the load-time probe refuses, naming
    the family."""
    adapter = HFModelAdapter(tiny(family))
    assert probe_trees(adapter) is None
    adapter.attention = dataclasses.replace(adapter.attention, windows={}, layer_types=())
    line = probe_trees(adapter)
    assert line is not None and line.startswith(
        "the transformers fallback cannot verify trees for "
    )
    assert "\n" not in line and "without --drafter" in line


def test_features_it_cannot_mask_are_refused_with_one_line_but_plain_decoding_runs():
    model = tiny("llama")
    # chunked attention (Llama 4): the fallback does not chunk tree masks
    model.config.attention_chunk_size = 4
    adapter = HFModelAdapter(model)
    assert (
        adapter.tree_refusal
        == "the transformers fallback cannot verify trees for Llama with chunked attention (chunks"
        " of 4): the fallback does not chunk its tree masks; serve it without --drafter (plain"
        " generation through the fallback is exact) or with --backend lean once the lean decoder"
        " supports it"
    )
    with pytest.raises(UnsupportedArchitecture, match="chunked attention"):
        adapter.check_speculative()
    cache = adapter.allocate_cache(8)
    with pytest.raises(
        UnsupportedArchitecture, match="chunked attention"
    ):  # never served wrong, even called directly
        adapter(torch.tensor([3, 4]), cache, tree_mask=torch.ones(2, 2, dtype=torch.bool).tril())
    assert len(generate_ar(adapter, [3, 4, 5], 4)) == 4


def test_unproven_families_are_probed_once_at_load(monkeypatch):
    adapter = HFModelAdapter(tiny("llama"))
    calls = []
    monkeypatch.setattr("draftsmith.runtime.target.hf.PROVEN_FAMILIES", ())
    monkeypatch.setattr(
        "draftsmith.runtime.target.hf.probe_trees", lambda a: calls.append(a) or "refused: probe"
    )
    with pytest.raises(UnsupportedArchitecture, match="refused: probe"):
        adapter.check_speculative()
    with pytest.raises(UnsupportedArchitecture, match="refused: probe"):
        adapter.check_speculative()
    assert len(calls) == 1


@pytest.fixture(scope="module")
def gpt2_target(tmp_path_factory, tiny_tokenizer):
    """A target folder the lean decoder does not run (GPT-2: learned positions, LayerNorm, GELU)."""
    path = tmp_path_factory.mktemp("gpt2_target")
    tiny("gpt2", vocab=len(tiny_tokenizer)).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def test_choose_decoder_says_which_ran_and_why(tiny_target_dir, gpt2_target):
    assert choose_decoder(tiny_target_dir)[1:] == (
        "lean",
        "auto: the lean decoder supports this model",
    )
    assert choose_decoder(tiny_target_dir, backend="hf")[1:] == ("hf", "forced by --backend hf")
    model, backend, why = choose_decoder(gpt2_target)
    assert isinstance(model, HFModelAdapter) and backend == "hf"
    assert why.startswith("auto: the lean decoder cannot run it (") and "gpt2" in why
    with pytest.raises(UnsupportedArchitecture, match=r"^--backend lean: .*gpt2") as err:
        choose_decoder(gpt2_target, backend="lean")
    assert "\n" not in str(err.value)
    with pytest.raises(
        ValueError, match="decoder backend must be one of auto, lean, hf, got 'vllm'"
    ):
        choose_decoder(tiny_target_dir, backend="vllm")


def test_generate_backend_flag(tiny_target_dir, gpt2_target, capsys):
    base = [
        "generate",
        "--prompt",
        "hello world",
        "--max-new-tokens",
        "4",
        "--dtype",
        "fp32",
        "--verbose",
    ]
    assert cli.main([*base, "--target", str(tiny_target_dir), "--backend", "hf"]) == 0
    err = capsys.readouterr().err
    assert "[decoder_backend] hf" in err and "[decoder_reason] forced by --backend hf" in err
    assert cli.main([*base, "--target", str(tiny_target_dir)]) == 0
    assert "[decoder_backend] lean" in capsys.readouterr().err
    # auto: the fallback, and it says why
    assert cli.main([*base, "--target", str(gpt2_target)]) == 0
    err = capsys.readouterr().err
    assert (
        "[decoder_backend] hf" in err
        and "[decoder_reason] auto: the lean decoder cannot run it" in err
    )
    assert cli.main([*base, "--target", str(gpt2_target), "--backend", "lean"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert (
        lines[-1].startswith("draftsmith generate: error: --backend lean: ") and "gpt2" in lines[-1]
    )
    # one line, no traceback
    assert cli.main([*base, "--target", str(tiny_target_dir), "--backend", "vllm"]) == 2
    assert "invalid choice: 'vllm'" in capsys.readouterr().err
