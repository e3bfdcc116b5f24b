"""Reading chat data: every record format normalised to role/content turns, JSONL, truncated JSON
arrays, parquet and folders of mixed files read, and bad files named with their line."""

from __future__ import annotations

import json

import pytest
from chat_files import varied_conversations, write_jsonl

from draftsmith.common.errors import DataError
from draftsmith.distill.data.conversations import load_conversations, normalize_record

pytestmark = pytest.mark.unit


RECORDS = [
    {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"}]},
    {"messages": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]},
    {"prompt": "q3", "response": "a3"},
    {"conversations": [{"from": "human", "value": "only a question"}]},
]


def test_normalize_formats():
    want = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert (
        normalize_record(
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
        )
        == want
    )
    assert (
        normalize_record(
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
        )
        == want
    )
    assert normalize_record({"prompt": "q", "response": "a"}) == want
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "q"}]},
            {"role": "assistant", "content": "a"},
        ]
    }
    assert normalize_record(parts) == want
    assert normalize_record({"prompt": "q", "completion": "a", "system": "s"})[0] == {
        "role": "system",
        "content": "s",
    }
    with pytest.raises(ValueError, match="unknown role 'robot'"):
        normalize_record({"conversations": [{"from": "robot", "value": "x"}]})
    with pytest.raises(ValueError, match="unknown record structure"):
        normalize_record({"text": "x"})


def test_load_jsonl_drops_no_assistant(tmp_path):
    convs, report = load_conversations(str(write_jsonl(tmp_path / "d.jsonl", RECORDS)))
    assert [c[-1]["content"] for c in convs] == ["a1", "a2", "a3"]
    assert (report.kept, report.skipped, report.turns) == (3, 1, 6)
    assert "without an assistant turn" in report.reason
    convs, report = load_conversations(str(tmp_path / "d.jsonl"), limit=2)
    assert len(convs) == 2


def test_load_truncated_json_array(tmp_path):
    text = json.dumps(RECORDS[:3] + [RECORDS[0]])
    (tmp_path / "d.json").write_text(text[:-10])
    convs, report = load_conversations(str(tmp_path / "d.json"))
    assert len(convs) == 3 and report.skipped == 1 and "truncated" in report.reason


def test_load_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": f"a{i}"},
            ]
        }
        for i in range(5)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    convs, report = load_conversations(str(tmp_path / "d.parquet"))
    assert report.kept == 5 and convs[4] == rows[4]["messages"]


def test_load_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(RECORDS[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        load_conversations(str(bad))
    odd = write_jsonl(tmp_path / "odd.jsonl", [RECORDS[0], {"text": "plain"}])
    with pytest.raises(ValueError, match=r"odd\.jsonl:2: unknown record structure"):
        load_conversations(str(odd))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_conversations(str(tmp_path / "missing.jsonl"))


def test_a_data_folder_of_mixed_files_reads_every_chat_file_and_names_the_rest(tmp_path, caplog):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "mixed"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", varied_conversations(6))
    rows = varied_conversations(10)[6:]
    pq.write_table(pa.Table.from_pylist(rows), folder / "b.parquet")
    (folder / "junk.bin").write_bytes(bytes(range(256)))
    (folder / "notes.txt").write_text("not data")
    with caplog.at_level("WARNING"):
        conversations, report = load_conversations(str(folder))
    # `datasets` read the parquet alone: 4 of 10, silently
    assert len(conversations) == 10 and report.kept == 10
    assert (
        "skipping 2 file(s) that are not .jsonl/.json/.parquet: junk.bin, notes.txt" in caplog.text
    )
    alien = {"conversations": [{"from": "alien", "value": "x"}]}
    pq.write_table(pa.Table.from_pylist([*rows, alien]), folder / "b.parquet")
    with pytest.raises(DataError, match=r"b\.parquet:5: message 0 has unknown role 'alien'"):
        load_conversations(str(folder))


def test_a_utf8_bom_is_read_and_utf16_is_named(tmp_path):
    rows = "\n".join(json.dumps(c) for c in varied_conversations(3)) + "\n"
    (tmp_path / "bom.jsonl").write_bytes(
        b"\xef\xbb\xbf" + rows.encode()
    )  # as Windows editors save it
    assert len(load_conversations(str(tmp_path / "bom.jsonl"))[0]) == 3
    (tmp_path / "u16.jsonl").write_bytes(rows.encode("utf-16"))
    with pytest.raises(DataError, match=r"u16\.jsonl is UTF-16 text: save it as UTF-8"):
        load_conversations(str(tmp_path / "u16.jsonl"))
