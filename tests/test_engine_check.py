"""``draftsmith engine-check`` (issue 40): both engines are fed the same prompt ids (llama.cpp's
tokenization), llama.cpp's generated ids are read off its verbose eval log, and the generated ids
are compared as ids (agreeing at EOS and at the cut), not as decoded texts."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from draftsmith.bench import llamacpp
from draftsmith.evals.engine_check_report import markdown

pytestmark = pytest.mark.unit


VERBOSE_LOG = """\
0.00.891.778 I llama_completion: number of tokens in prompt = 3
0.00.891.812 I      1 -> '<|im_start|>'
0.00.891.847 I   9690 -> 'system'
0.00.891.881 I    198 -> '
'
0.00.900.001 D eval: [ '<|im_start|>':1, 'system':9690, '':198 ]
0.00.900.002 D n_past = 3
0.00.950.001 D eval: [ ' The':378 ]
0.00.990.001 D eval: [ ' a, b':64 ]
0.01.030.001 D eval: [ ''':11 ]
"""


def test_llamacpp_generated_ids_are_read_from_its_verbose_eval_log():
    assert llamacpp.parse_generated_ids(VERBOSE_LOG, llamacpp.parse_prompt_ids(VERBOSE_LOG)) == [
        378,
        64,
        11,
    ]
    assert llamacpp.parse_generated_ids(VERBOSE_LOG, None) == [
        378,
        64,
        11,
    ]  # the first line is the prompt's
    assert llamacpp.parse_generated_ids("no debug log", [1]) is None
    argv = llamacpp.completion_command(Path("t.gguf"), "hi", 8, 2, 512, log_ids=True)
    assert argv[-1] == "-v" and "-v" not in llamacpp.completion_command(
        Path("t.gguf"), "hi", 8, 2, 512
    )


def test_generated_ids_agree_at_eos_and_at_the_cut():
    from draftsmith.evals.engine_agreement import generated_ids_agree

    eos = (2,)
    assert generated_ids_agree(
        [5, 6, 2], [5, 6], eos, engine_stopped_at_eos=True
    )  # text differs here: <|im_end|>
    assert not generated_ids_agree(
        [5, 6, 7], [5, 6], eos, engine_stopped_at_eos=True
    )  # ours ran on
    assert generated_ids_agree(
        [5, 6, 7], [5, 6], eos, engine_stopped_at_eos=False
    )  # cut at -n: last never evaluated
    assert generated_ids_agree([5, 6], [5, 6], eos, engine_stopped_at_eos=False)
    assert not generated_ids_agree([5, 9, 7], [5, 6], eos, engine_stopped_at_eos=False)
    assert not generated_ids_agree([5, 6, 7, 8], [5, 6], eos, engine_stopped_at_eos=False)


def fake_engines(monkeypatch, tokenizer, hf_ids: list, engine_ids: list, eos: int) -> list:
    """Both engines replaced by fakes on the tiny tokenizer: llama.cpp (which must get the rendered
    text of ``hf_ids`` and reports ``engine_ids`` as its prompt ids) and our runtime (which records
    the prompt ids it decodes in the returned list)."""
    from draftsmith.evals import engine_check as ec
    from draftsmith.runtime import serving

    runtime = SimpleNamespace(tokenizer=tokenizer, eos_ids=(eos,), inference={})
    fed = []

    def fake_row(gguf, ids, max_new_tokens, threads, tokenizer, log_ids=False):
        # llama.cpp gets the rendered text of the HF ids
        assert log_ids and [list(p) for p in ids] == hf_ids
        return {
            "texts": ["a b", "a b c"],
            "stopped_at_eos": [True, False],
            "prompt_ids": engine_ids,
            "generated_ids": [[40, 41], [40, 41, 42]],
            "prompt_ids_match": False,
        }

    def fake_runtime_side(rt, ids, max_new_tokens):
        fed.extend(ids)
        return {"tau": 1.5, "lossless": True, "ar_outputs": [[40, 41, eos], [40, 41, 42, 43]]}

    monkeypatch.setattr(ec, "read_config", lambda folder: {"method": "eagle3"})
    monkeypatch.setattr(ec.llamacpp_build, "missing_build_reason", lambda: None)
    monkeypatch.setattr(ec.llamacpp, "llamacpp_row", fake_row)
    monkeypatch.setattr(
        ec, "llamacpp_speculative", lambda *a: {"texts": ["a b", "a b c"], "n_draft_max": 4}
    )
    monkeypatch.setattr(ec, "runtime_side", fake_runtime_side)
    monkeypatch.setattr(ec, "runtime_options", lambda export_dir, n_max: ({}, f"fixed:{n_max}"))
    monkeypatch.setattr(serving, "load_runtime", lambda *a, **k: runtime)
    return fed


def with_speeds(result: dict) -> dict:
    """An engine-check result with the speed and acceptance fields ``markdown`` reads (the fakes
    measure none)."""
    return {
        **result,
        "llamacpp": {
            **result["llamacpp"],
            "plain": {"decode_tokens_per_s": 1.0, "tokens_per_s_incl_prompt": 1.0},
            "speculative": {
                "n_draft_max": 4,
                "tau": 1.5,
                "acceptance": 0.5,
                "decode_tokens_per_s": 1.0,
                "tokens_per_s_incl_prompt": 1.0,
            },
        },
        "runtime": {
            **result["runtime"],
            "dtype": "fp32",
            "acceptance": 0.5,
            "ar_tokens_per_s": 1.0,
            "speculative_tokens_per_s": 1.0,
        },
    }


def test_engine_check_feeds_both_engines_the_same_ids_and_compares_ids(
    tiny_tokenizer, tmp_path, monkeypatch
):
    """llama.cpp tokenizes some prompts unlike the HF tokenizer; engine-check used to run our
    runtime on the HF ids (different prompts) and compare decoded texts, False whenever generation
    stopped at EOS."""
    from draftsmith.bench.prompts import load_prompts
    from draftsmith.evals import engine_check as ec

    export = tmp_path / "export"
    export.mkdir()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "hello world"}) + "\n" + json.dumps({"prompt": "what is it"}) + "\n"
    )
    hf_ids = load_prompts(str(prompts), tiny_tokenizer, None)
    engine_ids = [
        hf_ids[0][:-1] + [hf_ids[0][-1], 7],
        list(hf_ids[1]),
    ]  # llama.cpp splits prompt 0 differently
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    fed = fake_engines(monkeypatch, tiny_tokenizer, hf_ids, engine_ids, eos)
    result = ec.engine_check(export, "t.gguf", "d.gguf", str(prompts), 2, 4)
    assert fed == engine_ids  # our runtime decoded llama.cpp's ids, not the HF tokenizer's
    assert result["runtime"]["ids_equal_llamacpp_plain"] == [
        True,
        True,
    ]  # EOS kept by ours, dropped by llama.cpp
    assert result["prompt_ids_match"] is True and result["prompt_ids"]["hf_tokenizer_differs"] == [
        0
    ]
    assert (
        "the same prompt ids in both engines (llama.cpp's tokenization); the HF tokenizer splits"
        " prompts [0]" in markdown(with_speeds(result))
    )
