"""Tokenising conversations: the loss mask covers exactly the assistant tokens (tiny and real
SmolLM2 chat templates, leading assistant turns, truncation), templates the mask cannot follow are
refused, and MT-Bench prompts end with the assistant's generation prompt."""

from __future__ import annotations

import pytest
from conftest import build_tiny_tokenizer

from draftsmith.distill.data.samples import TemplateError, tokenize_conversation

pytestmark = pytest.mark.unit

CONV = [
    {"role": "system", "content": "you are a hot python"},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "the answer is python ."},
    {"role": "user", "content": "explain why ?"},
    {"role": "assistant", "content": "it is I like code !"},
]


def _masked_runs(tokens: list, mask: list[int]) -> list[list]:
    """Contiguous runs of masked tokens."""
    runs, current = [], []
    for tok, m in zip(tokens, mask):
        if m:
            current.append(tok)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


# ----------------------------------------------------------------------------- loss mask


def test_mask_covers_exactly_assistant_tokens(tiny_tokenizer):
    out = tokenize_conversation(tiny_tokenizer, CONV, 256)
    tokens = tiny_tokenizer.convert_ids_to_tokens(out["input_ids"])
    assert len(out["loss_mask"]) == len(tokens)
    assert _masked_runs(tokens, out["loss_mask"]) == [
        ["the", "answer", "is", "python", ".", "<|im_end|>"],
        ["it", "is", "I", "like", "code", "!", "<|im_end|>"],
    ]
    assert (
        out["input_ids"]
        == tiny_tokenizer(
            tiny_tokenizer.apply_chat_template(CONV, tokenize=False), add_special_tokens=False
        )["input_ids"]
    )


def test_mask_leading_assistant_and_truncation(tiny_tokenizer):
    out = tokenize_conversation(tiny_tokenizer, CONV[2:], 256)
    tokens = tiny_tokenizer.convert_ids_to_tokens(out["input_ids"])
    assert _masked_runs(tokens, out["loss_mask"])[0] == [
        "the",
        "answer",
        "is",
        "python",
        ".",
        "<|im_end|>",
    ]
    full = tokenize_conversation(tiny_tokenizer, CONV, 256)
    cut = tokenize_conversation(tiny_tokenizer, CONV, 17)
    assert cut["input_ids"] == full["input_ids"][:17] and cut["loss_mask"] == full["loss_mask"][:17]


def test_unsupported_templates_raise():
    tok = build_tiny_tokenizer()
    tok.chat_template = (  # no roles, no generation prompt
        "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    )
    with pytest.raises(TemplateError, match="unsupported"):
        tokenize_conversation(tok, CONV, 64)
    tok.chat_template = (
        "{{ messages[-1]['content'] }}{% if add_generation_prompt %}<|im_start|>assistant\n{%"
        " endif %}"
    )
    with pytest.raises(TemplateError, match="earlier turns"):
        tokenize_conversation(tok, CONV, 64)


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from transformers import AutoTokenizer

    from draftsmith.assets import default_target_dir

    return AutoTokenizer.from_pretrained(default_target_dir())


@pytest.mark.integration
def test_mask_with_real_smollm2_template(smollm_tokenizer):
    tok = smollm_tokenizer
    conv = [
        {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken\ncross the road?"},
    ]
    for messages in (
        conv,
        conv[1:],
    ):  # the second starts with an assistant turn (common in ShareGPT)
        out = tokenize_conversation(tok, messages, 512)
        runs = [tok.decode(r) for r in _masked_runs(out["input_ids"], out["loss_mask"])]
        assert runs == [
            "Hello! How can I help?<|im_end|>",
            "Why did the chicken\ncross the road?<|im_end|>",
        ]
        assert (
            out["input_ids"]
            == tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)[
                "input_ids"
            ]
        )
