"""Training and serving encode a chat the same way (one function in draftsmith.common.chat)."""

import json

import pytest

from draftsmith.bench.prompts import load_prompts
from draftsmith.common.chat import encode_chat, render_chat
from draftsmith.distill.data.samples import tokenize_conversation

pytestmark = pytest.mark.unit


def test_training_and_bench_produce_the_same_prompt_ids(tiny_tokenizer, tmp_path):
    user, reply = "please explain the code", "the answer is python ."
    trained = tokenize_conversation(
        tiny_tokenizer,
        [{"role": "user", "content": user}, {"role": "assistant", "content": reply}],
        max_length=256,
    )
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": user}) + "\n")
    served = load_prompts(str(prompts), tiny_tokenizer, None)[0]
    # The bench's prompt is exactly the training sequence up to the first assistant token.
    first_assistant = trained["loss_mask"].index(1)
    assert served == trained["input_ids"][:first_assistant]
    assert (
        served
        == encode_chat(tiny_tokenizer, user)
        == encode_chat(tiny_tokenizer, [{"role": "user", "content": user}])
    )


def test_chat_encoding_errors_are_actionable(tiny_tokenizer):
    with pytest.raises(ValueError, match="empty prompt"):
        encode_chat(tiny_tokenizer, "  ")

    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        render_chat(NoTemplate(), [{"role": "user", "content": "hi"}])


def test_a_prompt_beyond_the_context_fails_at_once_naming_it(tiny_tokenizer, tmp_path):
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "hello"}) + "\n" + json.dumps({"prompt": "the word " * 600}) + "\n"
    )
    # no limit given: nothing refused
    assert len(load_prompts(str(prompts), tiny_tokenizer, None)) == 2
    with pytest.raises(
        ValueError,
        match=r"prompt 2 of .*long.jsonl.* has \d+ tokens but the target's context is 512",
    ):
        load_prompts(str(prompts), tiny_tokenizer, None, max_len=512)


def test_a_slice_of_a_prompt_set_takes_exactly_those_prompts(tiny_tokenizer, tmp_path):
    every = load_prompts("mtbench", tiny_tokenizer, None)
    # disjoint from a bench's first 8
    assert load_prompts("mtbench[40:]", tiny_tokenizer, None) == every[40:]
    # the limit counts inside the slice
    assert load_prompts("mtbench[40:48]", tiny_tokenizer, 3) == every[40:43]
    assert load_prompts("humaneval[:2]", tiny_tokenizer, None) == load_prompts(
        "humaneval", tiny_tokenizer, 2
    )
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(5)))
    assert (
        load_prompts(f"{prompts}[3:]", tiny_tokenizer, None)
        == load_prompts(str(prompts), tiny_tokenizer, None)[3:]
    )
    with pytest.raises(
        ValueError, match=r"mtbench\[90:\] selects no prompts: mtbench has 80, and \[90:\] is empty"
    ):
        load_prompts("mtbench[90:]", tiny_tokenizer, None)
    odd = tmp_path / "odd[1:2]"  # a file whose name looks like a slice is read as that file
    odd.write_text(json.dumps({"prompt": "only one"}) + "\n")
    assert len(load_prompts(str(odd), tiny_tokenizer, None)) == 1
