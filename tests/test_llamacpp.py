"""llama.cpp as the bench's peer: its output parsed, a missing build named with what to run, the
cached build used."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from draftsmith.bench import llamacpp, llamacpp_build
from draftsmith.bench.report import _peer_rows

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]

# stderr of a real `llama-completion --verbose-prompt` run (llama-cpp-python 0.3.36's llama.cpp,
# SmolLM2-135M Q4_1, 2 threads, 8 new tokens, the chat-encoded prompt "Hi"; on a busy machine) from
# the prompt on, less the sampler settings and the empty lines; its default log format starts each
# line with a timestamp and a level
REAL_LOG = (
    """\
0.00.891.739 I llama_completion: prompt: '<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
<|im_start|>user
Hi<|im_end|>
<|im_start|>assistant
'
0.00.891.778 I llama_completion: number of tokens in prompt = 31
0.00.891.812 I      1 -> '<|im_start|>'
0.00.891.847 I   9690 -> 'system'
0.00.891.881 I    198 -> '
'
0.00.891.914 I   2683 -> 'You'
0.00.891.949 I    359 -> ' are'
0.00.891.982 I    253 -> ' a'
0.00.892.017 I   5356 -> ' helpful'
0.00.892.051 I   5646 -> ' AI'
0.00.892.084 I  11173 -> ' assistant'
0.00.892.119 I   3365 -> ' named'
0.00.892.150 I   3511 -> ' Sm'
0.00.892.151 I    308 -> 'ol'
0.00.892.151 I  34519 -> 'LM'
0.00.892.152 I     28 -> ','
0.00.892.152 I   7018 -> ' trained'
0.00.892.153 I    411 -> ' by'
0.00.892.153 I    407 -> ' H'
0.00.892.154 I  19712 -> 'ugging'
0.00.892.154 I   8182 -> ' Face'
0.00.892.154 I      2 -> '<|im_end|>'
0.00.892.154 I    198 -> '
'
0.00.892.155 I      1 -> '<|im_start|>'
0.00.892.155 I   4093 -> 'user'
0.00.892.155 I    198 -> '
'
0.00.892.156 I  26843 -> 'Hi'
0.00.892.156 I      2 -> '<|im_end|>'
0.00.892.156 I    198 -> '
'
0.00.892.156 I      1 -> '<|im_start|>'
0.00.892.157 I    520 -> 'ass'
0.00.892.157 I   9531 -> 'istant'
0.00.892.157 I    198 -> '
'
0.00.892.163 I sampler seed: 0
0.00.892.177 I generate: n_ctx = 512, n_batch = 2048, n_predict = 8, n_keep = 0
"""
    + "0.03.970.776 I common_perf_print:    sampling time =       0.71 ms\n"
    "0.03.970.777 I common_perf_print:    samplers time =       0.16 ms /    39 tokens\n"
    "0.03.970.779 I common_perf_print:        load time =     608.35 ms\n"
    "0.03.970.780 I common_perf_print: prompt eval time =    1896.85 ms /    31 tokens"
    " (   61.19 ms per token,    16.34 tokens per second)\n"
    "0.03.970.781 I common_perf_print:        eval time =    1163.61 ms /     7 runs  "
    " (  166.23 ms per token,     6.02 tokens per second)\n"
    "0.03.970.782 I common_perf_print:       total time =    3084.80 ms /    38 tokens\n"
    "0.03.970.782 I common_perf_print: unaccounted time =      23.63 ms /   0.8 %     "
    " (total - sampling - prompt eval - eval) / (total)\n"
    "0.03.970.782 I common_perf_print:    graphs reused =          6\n"
)


def test_the_perf_counters_and_prompt_ids_are_read_from_a_real_log():
    perf = llamacpp.parse_perf(REAL_LOG)
    assert perf == {
        "prompt_ms": 1896.85,
        "prompt_tokens": 31,
        "decode_ms": 1163.61,
        "decode_runs": 7,
    }
    ids = llamacpp.parse_prompt_ids(
        REAL_LOG
    )  # pieces holding a newline ('\n' is token 198) included
    assert len(ids) == 31 and ids[:4] == [1, 9690, 198, 2683] and ids[-4:] == [1, 520, 9531, 198]
    assert llamacpp.parse_prompt_ids("no verbose prompt here") is None
    with pytest.raises(ValueError, match="eval time"):
        llamacpp.parse_perf("main: error: unable to load model")


def test_the_generated_text_is_read_from_stdout():
    # real stdouts: stopped at EOS within 16 tokens (BF16), and cut at 16 tokens (Q4_1)
    assert llamacpp.parse_output("The capital of France is Paris. [end of text]\n\n\n") == (
        "The capital of France is Paris.",
        True,
    )
    assert llamacpp.parse_output("L'Étoile, la Marseillaise, la femme au\n\n") == (
        "L'Étoile, la Marseillaise, la femme au",
        False,
    )


def test_a_missing_build_is_named_with_the_command_that_makes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    reason = llamacpp_build.missing_build_reason()
    assert reason.startswith("not built: run `make llamacpp` (one-time, ~")
    assert llamacpp.llamacpp_peers([[1, 2]], None, 8) == {"skipped": reason}
    with pytest.raises(llamacpp_build.LlamaCppMissing, match="make llamacpp"):
        llamacpp.llamacpp_row(tmp_path / "x.gguf", ["hi"], 8)
    (tmp_path / f"llamacpp-{llamacpp_build.VERSION}.failed").write_text(
        "step: build\nc++: fatal error: Killed signal\n"
    )
    assert (
        "build failed (step: build | c++: fatal error: Killed signal)"
        in llamacpp_build.missing_build_reason()
    )
    assert "retry: make llamacpp" in llamacpp_build.missing_build_reason()


def test_the_build_script_returns_at_once_when_cached(tmp_path):
    root = tmp_path / f"llamacpp-{llamacpp_build.VERSION}"
    root.mkdir()
    (root / ".done").write_text("built\n")
    (root / "build_seconds").write_text("600\n")
    start = time.perf_counter()
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build_llamacpp.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "DRAFTSMITH_CACHE": str(tmp_path)},
        check=True,
    )
    assert time.perf_counter() - start < 1.0
    assert "cached" in out.stdout and "600 s" in out.stdout


def test_the_report_puts_llama_cpp_next_to_runtime_ar():
    row = {
        "decode_tokens_per_s": 200.0,
        "tokens_per_s_incl_prompt": 160.0,
        "prompt_tokens_per_s": 900.0,
        "threads": 2,
        "prompt_ids_match": True,
    }
    result = {
        "tokens_per_s": {"runtime_ar": 80.0},
        "peers": {"llamacpp": {"q4_1": row, "bf16": {"skipped": "no GGUF file at x"}}},
    }
    rows = dict(_peer_rows(result))
    assert rows["llama.cpp Q4_1 tok/s"].startswith("200.0 decode; 160.0 incl. prompt eval")
    assert "same prompt ids" in rows["llama.cpp Q4_1 tok/s"]
    assert rows["llama.cpp BF16 tok/s"] == "skipped: no GGUF file at x"
    assert rows["runtime AR / llama.cpp (both incl. prompt eval)"] == "Q4_1 0.50 (decode-only 0.40)"
    assert _peer_rows({"tokens_per_s": {"runtime_ar": 1.0}}) == []
    skipped = {"peers": {"llamacpp": {"skipped": "not built"}}}
    assert dict(_peer_rows(skipped)) == {"llama.cpp tok/s": "skipped: not built"}


def test_bench_takes_the_flag():
    from draftsmith.cli import build_parser

    args = build_parser("bench").parse_args(["bench", "--drafter", "x", "--llamacpp"])
    assert args.llamacpp
    assert not build_parser("bench").parse_args(["bench", "--drafter", "x"]).llamacpp


@pytest.mark.integration
def test_the_cached_build_decodes_a_chat_prompt_greedily_from_both_weight_files():
    reason = llamacpp_build.missing_build_reason()
    if reason:
        pytest.skip(reason)
    from transformers import AutoTokenizer

    from draftsmith import assets
    from draftsmith.common.chat import encode_chat

    try:
        gguf, folder = assets.gguf_path(), assets.default_target_dir()
    except assets.AssetError as err:
        pytest.skip(str(err))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = encode_chat(tokenizer, "What is the capital of France?")
    peers = llamacpp.llamacpp_peers([ids], tokenizer, 8, 2, folder, runtime_ar_tokens_per_s=100.0)
    for key in ("q4_1", "bf16"):  # the BF16 file is converted once with the cached converter
        row = peers[key]
        assert "skipped" not in row, row
        assert row["prompt_ids_match"], (
            f"llama.cpp tokenized the rendered chat prompt differently ({key})"
        )
        assert row["per_prompt"][0]["prompt_tokens"] == len(ids)
        assert (
            1 <= row["new_tokens"] <= 8
            and row["decode_tokens_per_s"] > 0
            and row["texts"][0].strip()
        )
        assert row["runtime_ar_over_llamacpp"] == pytest.approx(
            100.0 / row["tokens_per_s_incl_prompt"]
        )
    again = llamacpp.llamacpp_row(gguf, [ids], 8, threads=2, tokenizer=tokenizer)
    assert again["texts"] == peers["q4_1"]["texts"]  # greedy: the same text every time
