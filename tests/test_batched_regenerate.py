"""``draftsmith regenerate --batch-size N``: batched greedy first turns equal batch 1 token for
token (fp32), resume byte for byte with the same batch size, refuse another, fall back to batch 1
where batching cannot run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_llama

from draftsmith.datagen import regenerate as regen
from draftsmith.datagen import regeneration_pass
from draftsmith.datagen.batched_generation import batch_support, generate_greedy_batch
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.target.loading import load_decoder

pytestmark = pytest.mark.unit

SMALL = dict(max_new_tokens=12, dtype="fp32")


@pytest.fixture(scope="module")
def lively_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """The tiny Llama with larger weights: its greedy replies vary token to token (the default one
    repeats a token), so a wrong position, mask or slot changes the output."""
    path = tmp_path_factory.mktemp("lively_target")
    build_tiny_llama(len(tiny_tokenizer), initializer_range=0.3).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def decoder(lively_dir):
    return load_decoder(lively_dir, dtype=torch.float32)


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randint(4, 100, (3 + 5 * i % 17,), generator=gen).tolist() for i in range(n)
    ]  # 3..19 tokens


def test_batched_greedy_equals_batch_one_with_refills_and_an_early_eos(decoder):
    prompts = _prompts(7)
    budgets = [12, 5, 12, 9, 12, 1, 12]
    free = [generate_ar(decoder, p, b) for p, b in zip(prompts, budgets)]
    eos = {
        free[0][2]
    }  # row 0 stops at its third token: its slot is refilled while the others run on
    want = [generate_ar(decoder, p, b, eos_ids=eos) for p, b in zip(prompts, budgets)]
    assert len(want[0]) == 3 and sum(len(w) == b for w, b in zip(want, budgets)) >= 5
    assert all(len(set(w)) >= min(len(w), 4) for w in want)  # varied replies: a slip shows
    finished: list[int] = []
    for batch_size in (1, 3, 16):
        finished.clear()
        got = generate_greedy_batch(
            decoder, prompts, budgets, eos, batch_size, done=lambda i, toks: finished.append(i)
        )
        assert got == want, f"batch {batch_size}"
        assert sorted(finished) == list(range(len(prompts)))


def test_batched_step_refuses_what_it_cannot_run(decoder, lively_dir):
    from draftsmith.runtime.target.hf import HFModelAdapter

    hf = HFModelAdapter.from_pretrained(lively_dir, torch.float32, "cpu")
    assert "no batched step" in batch_support(hf) and batch_support(decoder) is None
    with pytest.raises(ValueError, match="batched decoding is unavailable"):
        generate_greedy_batch(hf, [[5, 6]], [3])
    with pytest.raises(ValueError, match="at least one token"):
        generate_greedy_batch(decoder, [[]], [3])
    with pytest.raises(ValueError, match="one budget per prompt"):
        generate_greedy_batch(decoder, [[5, 6]], [3, 4])
    assert generate_greedy_batch(decoder, [], []) == []


def test_batched_file_equals_batch_one_file(lively_dir, tiny_data_file, tmp_path, monkeypatch):
    monkeypatch.setattr(regeneration_pass, "CHUNK_ROWS", 2)  # several chunks over 24 conversations
    one, four = tmp_path / "one.jsonl", tmp_path / "four.jsonl"
    logs: list[str] = []
    regen.regenerate(
        str(tiny_data_file), one, target=str(lively_dir), limit=24, batch_size=1, **SMALL
    )
    report = regen.regenerate(
        str(tiny_data_file),
        four,
        target=str(lively_dir),
        limit=24,
        batch_size=4,
        log=logs.append,
        **SMALL,
    )
    assert report.written == 24 and report.tokens > 24
    assert not any("one conversation at a time" in m for m in logs)  # really batched
    assert four.read_bytes() == one.read_bytes()
    assert [json.loads(line)["source_index"] for line in four.read_text().splitlines()] == list(
        range(24)
    )


def test_resume_mid_chunk_writes_the_same_bytes_and_another_batch_size_is_refused(
    lively_dir, tiny_data_file, tmp_path, monkeypatch
):
    monkeypatch.setattr(regeneration_pass, "CHUNK_ROWS", 2)  # chunks of 6 conversations at batch 3
    kwargs = dict(target=str(lively_dir), limit=14, batch_size=3, **SMALL)
    full, out = tmp_path / "full.jsonl", tmp_path / "out.jsonl"
    regen.regenerate(str(tiny_data_file), full, **kwargs)
    real, calls = regeneration_pass.append_line, {"n": 0}

    def crash_after_8(handle, record):
        if calls["n"] == 8:  # inside the second chunk
            raise KeyboardInterrupt
        calls["n"] += 1
        real(handle, record)

    monkeypatch.setattr(regeneration_pass, "append_line", crash_after_8)
    with pytest.raises(KeyboardInterrupt):
        regen.regenerate(str(tiny_data_file), out, **kwargs)
    monkeypatch.setattr(regeneration_pass, "append_line", real)
    partial = Path(f"{out}.partial")
    assert not out.exists() and len(partial.read_text().splitlines()) == 8
    with pytest.raises(ValueError, match="other settings.*differing: batch_size"):
        regen.regenerate(str(tiny_data_file), out, **{**kwargs, "batch_size": 4})
    logs: list[str] = []
    report = regen.regenerate(str(tiny_data_file), out, log=logs.append, **kwargs)
    assert report.resumed == 8 and report.written == 6 and "resuming" in logs[0]
    assert out.read_bytes() == full.read_bytes()


def test_partial_from_before_batching_resumes_at_batch_one(lively_dir, tiny_data_file, tmp_path):
    out = tmp_path / "old.jsonl"
    kwargs = dict(target=str(lively_dir), limit=3, **SMALL)
    regen.regenerate(str(tiny_data_file), out, batch_size=1, **kwargs)
    first = out.read_text().splitlines()[0]
    # an interrupted run: its partial, no finished file (a finished one is never replaced unasked)
    out.unlink()
    Path(f"{out}.partial").write_text(first + "\n")
    settings = {
        "data": str(tiny_data_file),
        "target": str(lively_dir),
        "max_new_tokens": 12,
        "temperature": 0.0,
        "top_p": 1.0,
        "turns": "first",
        "dtype": "fp32",
        "seed": 0,
    }  # no batch_size
    Path(f"{out}.partial.json").write_text(json.dumps(settings))
    report = regen.regenerate(str(tiny_data_file), out, batch_size=1, **kwargs)
    assert report.resumed == 1 and report.written == 2


def test_all_turns_and_sampling_fall_back_to_batch_one_with_a_log_line(
    lively_dir, tiny_data_file, tmp_path
):
    for extra, why in (({"turns": "all"}, "--turns all"), ({"temperature": 0.8}, "sampling")):
        logs: list[str] = []
        regen.regenerate(
            str(tiny_data_file),
            tmp_path / f"{why}.jsonl",
            target=str(lively_dir),
            limit=2,
            batch_size=4,
            log=logs.append,
            **SMALL,
            **extra,
        )
        assert any(
            m.startswith("--batch-size 4: " + why) and "one conversation at a time" in m
            for m in logs
        )
    with pytest.raises(ValueError, match="--batch-size must be >= 1"):
        regen.regenerate(
            str(tiny_data_file), tmp_path / "x.jsonl", target=str(lively_dir), batch_size=0
        )


def test_cli_passes_the_batch_size(lively_dir, tiny_data_file, tmp_path, capsys):
    from draftsmith.cli import main

    out = tmp_path / "cli.jsonl"
    assert (
        main(
            [
                "regenerate",
                "--data",
                str(tiny_data_file),
                "--out",
                str(out),
                "--target",
                str(lively_dir),
                "--limit",
                "2",
                "--max-new-tokens",
                "4",
                "--dtype",
                "fp32",
                "--batch-size",
                "2",
            ]
        )
        == 0
    )
    assert "wrote" in capsys.readouterr().out and len(out.read_text().splitlines()) == 2
    assert (
        main(["regenerate", "--data", str(tiny_data_file), "--out", str(out), "--batch-size", "0"])
        == 2
    )
    assert "--batch-size must be >= 1" in capsys.readouterr().err
