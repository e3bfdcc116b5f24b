"""Every runtime target kind behind the one interface (runtime/target/interface.py): the lean Llama
decoder, a family decoder (Gemma-2), and the transformers fallback on GPT-2 and GPT-NeoX, each
through the plain loop and the speculative loop (chain and tree) with both LM heads, token-equal to
HF greedy ``generate``; and tiny GPT-2 and GPT-NeoX targets whose Medusa heads train two steps,
export and bench losslessly through the fallback.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.chain import ChainProposer, DecoderDrafter, SampledTreeProposer
from draftsmith.runtime.target.family_decoder import FamilyDecoder
from draftsmith.runtime.target.hf import HFModelAdapter
from draftsmith.runtime.target.interface import TargetDecoder
from draftsmith.runtime.target.loading import load_decoder
from draftsmith.runtime.target.model import LeanDecoder

pytestmark = pytest.mark.unit

VOCAB, NEW = 96, 24
PROMPT = [5, 17, 40, 3, 42, 8, 19, 77, 60, 2]
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    eos_token_id=None,
    bos_token_id=None,
)


def _hf(kind: str, vocab: int = VOCAB) -> tf.PreTrainedModel:
    """A random tiny HF causal LM of ``kind`` (fp32, eager attention) with sharp logits (no greedy
    ties)."""
    torch.manual_seed(0)
    small = {**SMALL, "vocab_size": vocab}
    config = {
        "lean_llama": lambda: tf.LlamaConfig(**small),
        "gemma2_family": lambda: tf.Gemma2Config(
            **small, head_dim=16, query_pre_attn_scalar=16, sliding_window=6
        ),
        "hf_gpt2": lambda: tf.GPT2Config(
            n_embd=32,
            n_layer=2,
            n_head=2,
            vocab_size=vocab,
            n_positions=256,
            eos_token_id=None,
            bos_token_id=None,
        ),
        "hf_gpt_neox": lambda: tf.GPTNeoXConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=vocab,
            max_position_embeddings=256,
            eos_token_id=None,
            bos_token_id=None,
        ),
    }[kind]()
    config._attn_implementation = "eager"  # Gemma-2's softcap is applied by the eager path only
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


KINDS = {
    "lean_llama": LeanDecoder,
    "gemma2_family": FamilyDecoder,
    "hf_gpt2": HFModelAdapter,
    "hf_gpt_neox": HFModelAdapter,
}


@pytest.fixture(scope="module", params=sorted(KINDS))
def kind(request, tmp_path_factory):
    """(name, HF model, the runtime decoder ``load_decoder`` picks for its saved folder, HF greedy
    continuation)."""
    hf = _hf(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    decoder = load_decoder(folder, kernel_backend="torch")
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False)[
            0, len(PROMPT) :
        ].tolist()
    return request.param, hf, decoder, want


def noisy(decoder: TargetDecoder):
    """The target itself as a drafter, deterministically wrong every third length: some drafts are
    rejected."""
    inner = DecoderDrafter(decoder, 128)

    def draft(ids: torch.Tensor) -> torch.Tensor:
        logits = inner(ids)
        return logits.roll(1) if len(ids) % 3 == 0 else logits

    return draft


def test_every_kind_implements_the_one_interface(kind):
    name, _, decoder, _ = kind
    assert type(decoder) is KINDS[name] and isinstance(decoder, TargetDecoder)
    # trees are exact on every kind here (GPT-NeoX: proven by the load-time probe)
    decoder.check_speculative()
    ids = torch.tensor(PROMPT)
    mask = torch.ones(len(PROMPT), len(PROMPT), dtype=torch.bool).tril()
    logits = decoder.forward(
        ids, decoder.allocate_cache(16), tree_mask=mask, taps=(1,)
    ).logits  # [T, V]
    out = decoder.forward(ids, decoder.allocate_cache(16), tree_mask=mask, taps=(1,), head="argmax")
    assert (
        out.logits is None and out.argmax.tolist() == logits.argmax(-1).tolist() and 1 in out.taps
    )
    with pytest.raises(ValueError, match="head must be 'logits' or 'argmax'"):
        decoder.forward(ids, decoder.allocate_cache(16), head="topk")


@pytest.mark.parametrize("head", ["auto", "logits"])
def test_plain_and_speculative_loops_equal_hf_greedy_on_every_kind(kind, head):
    """``head="auto"`` runs the argmax head wherever greedy allows it (every kind declares
    ``argmax_head``)."""
    name, _, decoder, want = kind
    assert generate_ar(decoder, PROMPT, NEW, head=head) == want, name
    chain = SpeculativeDecoder(decoder, ChainProposer(noisy(decoder), depth=3), head=head)
    assert chain.uses_argmax_head() == (head == "auto")
    got = chain.generate(PROMPT, NEW)
    assert got.tokens == want and got.tau > 1.2, name
    tree = SpeculativeDecoder(
        decoder, SampledTreeProposer(noisy(decoder), (2, 2, 1), temperature=0.0), head=head
    )
    assert tree.generate(PROMPT, NEW).tokens == want, name


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_gpt_neox"])
def test_a_fallback_target_trains_medusa_and_benches_losslessly(tmp_path, tiny_tokenizer, name):
    """GPT-2 and GPT-NeoX are served by the transformers fallback: two training steps of Medusa
    heads on each, an export, then the bench (its step-cost curve asks the target for the loop's LM
    head) with its lossless check against HF ``generate``."""
    from runtime_exports import medusa_export_for

    from draftsmith.bench.prompts import load_prompts
    from draftsmith.bench.run import run_bench
    from draftsmith.runtime.serving import load_runtime

    folder = tmp_path / name
    _hf(name, vocab=len(tiny_tokenizer)).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    export, losses = medusa_export_for(folder, tiny_tokenizer, tmp_path / "export", steps=2)
    assert len(losses) == 2 and all(map(torch.isfinite, torch.tensor(losses)))
    rt = load_runtime(str(export), str(folder), "fp32")
    assert rt.decoder_backend == "hf" and rt.speculative.max_cache_len is None
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in ("hello world", "what is the answer"))
    )
    result = run_bench(
        rt, load_prompts(str(prompts_file), rt.tokenizer, None), max_new_tokens=8, hf_dtype="same"
    )
    assert result["lossless"] is True, result["lossless_detail"]
