"""Tiny random models of every architecture users bring, built in-process (no hub), with the backend
that serves
each: the lean decoder (the Llama family and its relatives) or the transformers fallback. Windowed
families get a sliding window of :data:`WINDOW` tokens, so a test decoding 160 tokens runs far past
it."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf

VOCAB, WINDOW, CONTEXT = 96, 16, 256
LLAMA_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=CONTEXT,
)
GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW)
# name: (backend that serves it, config class, model class, config fields)
ARCHITECTURES = {
    "llama": ("lean", tf.LlamaConfig, tf.LlamaForCausalLM, LLAMA_LIKE),
    "qwen2": (
        "lean",
        tf.Qwen2Config,
        tf.Qwen2ForCausalLM,
        {
            **LLAMA_LIKE,
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 1,
        },
    ),
    "qwen3": (
        "lean",
        tf.Qwen3Config,
        tf.Qwen3ForCausalLM,
        {
            **LLAMA_LIKE,
            "head_dim": 16,
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 1,
        },
    ),
    "mistral": (
        "lean",
        tf.MistralConfig,
        tf.MistralForCausalLM,
        {**LLAMA_LIKE, "sliding_window": WINDOW},
    ),
    "gemma2": ("lean", tf.Gemma2Config, tf.Gemma2ForCausalLM, {**LLAMA_LIKE, **GEMMA}),
    "gemma3": (
        "lean",
        tf.Gemma3TextConfig,
        tf.Gemma3ForCausalLM,
        {**LLAMA_LIKE, **GEMMA, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "phi3": ("lean", tf.Phi3Config, tf.Phi3ForCausalLM, {**LLAMA_LIKE, "sliding_window": WINDOW}),
    "gpt2": (
        "hf",
        tf.GPT2Config,
        tf.GPT2LMHeadModel,
        dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=CONTEXT),
    ),
    "gpt_neox": (
        "hf",
        tf.GPTNeoXConfig,
        tf.GPTNeoXForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=CONTEXT,
        ),
    ),
    "falcon": (
        "hf",
        tf.FalconConfig,
        tf.FalconForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=CONTEXT,
        ),
    ),
    "stablelm": ("hf", tf.StableLmConfig, tf.StableLmForCausalLM, LLAMA_LIKE),
    "phi": ("hf", tf.PhiConfig, tf.PhiForCausalLM, {**LLAMA_LIKE, "num_key_value_heads": 4}),
    "granite": ("hf", tf.GraniteConfig, tf.GraniteForCausalLM, LLAMA_LIKE),
    "olmo2": ("hf", tf.Olmo2Config, tf.Olmo2ForCausalLM, LLAMA_LIKE),
    "opt": (
        "hf",
        tf.OPTConfig,
        tf.OPTForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=CONTEXT,
            word_embed_proj_dim=64,
        ),
    ),
}


def tiny_model(name: str, seed: int = 0) -> tf.PreTrainedModel:
    """A random tiny ``name`` model in fp32, eager attention, no EOS (greedy decodes run to their
    length), with a sharpened LM head (no greedy near-ties)."""
    _, config_cls, model_cls, fields = ARCHITECTURES[name]
    torch.manual_seed(seed)
    config = config_cls(**fields, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return model


def save_tiny(name: str, folder: Path, seed: int = 0) -> tf.PreTrainedModel:
    """:func:`tiny_model` saved to ``folder`` (config.json + model.safetensors)."""
    model = tiny_model(name, seed)
    model.save_pretrained(folder)
    return model


def greedy_generate(model: tf.PreTrainedModel, prompt: list[int], new: int) -> list[int]:
    """HF ``generate``'s greedy continuation of ``prompt`` (``new`` tokens): the reference."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
    return out[0, len(prompt) :].tolist()
