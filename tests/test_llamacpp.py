"""llama.cpp as the bench's peer: its output parsed, a missing build named with what to run, the cached build used."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from draftsmith.bench import llamacpp
from draftsmith.bench.report import _peer_rows

ROOT = Path(__file__).resolve().parents[1]

# stderr of a real `llama-completion --verbose-prompt` run (llama-cpp-python 0.3.36's llama.cpp, SmolLM2-135M Q4_1,
# 2 threads), the lines the parser reads and a few around them
REAL_LOG = """\
main: prompt: '<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
<|im_start|>user
Hi<|im_end|>
<|im_start|>assistant
'
main: number of tokens in prompt = 5
     1 -> '<|im_start|>'
  9690 -> 'system'
   198 -> '
'
  2683 -> 'You'
   359 -> ' are'

sampler seed: 0
generate: n_ctx = 512, n_batch = 2048, n_predict = 8, n_keep = 0
common_perf_print:    sampling time =       0.45 ms
common_perf_print:    samplers time =       0.21 ms /    13 tokens
common_perf_print:        load time =      64.05 ms
common_perf_print: prompt eval time =      21.13 ms /     5 tokens (    4.23 ms per token,   236.63 tokens per second)
common_perf_print:        eval time =      27.20 ms /     7 runs   (    3.89 ms per token,   257.35 tokens per second)
common_perf_print:       total time =      49.02 ms /    12 tokens
"""


def test_the_perf_counters_and_prompt_ids_are_read_from_a_real_log():
    perf = llamacpp.parse_perf(REAL_LOG)
    assert perf == {"prompt_ms": 21.13, "prompt_tokens": 5, "decode_ms": 27.20, "decode_runs": 7}
    assert llamacpp.parse_prompt_ids(REAL_LOG) == [1, 9690, 198, 2683, 359]  # a piece holding a newline included
    assert llamacpp.parse_prompt_ids("no verbose prompt here") is None
    with pytest.raises(ValueError, match="eval time"):
        llamacpp.parse_perf("main: error: unable to load model")


def test_a_missing_build_is_named_with_the_command_that_makes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    reason = llamacpp.missing_build_reason()
    assert reason.startswith("not built: run `make llamacpp` (one-time, ~")
    assert llamacpp.llamacpp_peers([[1, 2]], None, 8) == {"skipped": reason}
    with pytest.raises(llamacpp.LlamaCppMissing, match="make llamacpp"):
        llamacpp.llamacpp_row(tmp_path / "x.gguf", ["hi"], 8)
    (tmp_path / f"llamacpp-{llamacpp.VERSION}.failed").write_text("step: build\nc++: fatal error: Killed signal\n")
    assert "build failed (step: build | c++: fatal error: Killed signal)" in llamacpp.missing_build_reason()
    assert "retry: make llamacpp" in llamacpp.missing_build_reason()


def test_the_build_script_returns_at_once_when_cached(tmp_path):
    root = tmp_path / f"llamacpp-{llamacpp.VERSION}"
    root.mkdir()
    (root / ".done").write_text("built\n")
    (root / "build_seconds").write_text("600\n")
    start = time.perf_counter()
    out = subprocess.run(["bash", str(ROOT / "scripts" / "build_llamacpp.sh")], capture_output=True, text=True,
                         env={**os.environ, "DRAFTSMITH_CACHE": str(tmp_path)}, check=True)
    assert time.perf_counter() - start < 1.0
    assert "cached" in out.stdout and "600 s" in out.stdout


def test_the_report_puts_llama_cpp_next_to_runtime_ar():
    row = {"decode_tokens_per_s": 200.0, "tokens_per_s_incl_prompt": 160.0, "prompt_tokens_per_s": 900.0,
           "threads": 2, "prompt_ids_match": True}
    result = {"tokens_per_s": {"runtime_ar": 80.0},
              "peers": {"llamacpp": {"q4_1": row, "bf16": {"skipped": "no GGUF file at x"}}}}
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
def test_the_cached_build_decodes_a_chat_prompt_greedily():
    reason = llamacpp.missing_build_reason()
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
    row = llamacpp.llamacpp_row(gguf, [ids], 8, threads=2, tokenizer=tokenizer)
    assert row["prompt_ids_match"], "llama.cpp tokenized the rendered chat prompt differently"
    assert row["per_prompt"][0]["prompt_tokens"] == len(ids)
    assert 1 <= row["new_tokens"] <= 8 and row["decode_tokens_per_s"] > 0 and row["texts"][0].strip()
    again = llamacpp.llamacpp_row(gguf, [ids], 8, threads=2, tokenizer=tokenizer)
    assert again["texts"] == row["texts"]  # greedy: the same text every time
