"""Every folder draftsmith writes goes beside and is swapped in (common/atomic_folder.py): `export
--out` never replaces the user's folder or the export it converts, an earlier export is replaced
cleanly, temporaries a dead process left are removed at the next write (with a warning), and the
GGUF export names its drafter and the tools really built.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from export_faults import cli_error_line, dead_pid, run_folder_of, tree_snapshot

from draftsmith.cli import main
from draftsmith.common.atomic_folder import (
    OutputKind,
    OutputRefused,
    check_folder_target,
    scratch_folder,
    write_file,
    write_folder,
)
from draftsmith.export.format import EXPORT_OUTPUT, write_export

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PLAIN = OutputKind("report", lambda f: (f / "report.json").is_file(), ("report.json", "*.md"))


def users_folder(path: Path) -> Path:
    """A folder of the user's: keep.txt and sub/keep.txt."""
    (path / "sub").mkdir(parents=True)
    (path / "keep.txt").write_text("mine")
    (path / "sub" / "keep.txt").write_text("mine too")
    return path


@pytest.mark.parametrize("fmt", ["draftsmith", "medusa"])
def test_export_never_replaces_a_folder_that_is_not_an_export(capsys, tmp_path, medusa_export, fmt):
    source = (
        run_folder_of(medusa_export, tmp_path / "run") if fmt == "draftsmith" else medusa_export
    )
    out = users_folder(tmp_path / "DIR")
    before = tree_snapshot(out)
    line = cli_error_line(capsys, ["export", str(source), "--out", str(out), "--format", fmt])
    assert f"--out {out} exists and is not a draftsmith export (it holds keep.txt, sub/)" in line
    assert "nothing was written or deleted" in line
    assert tree_snapshot(out) == before  # both of the user's files, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["DIR", *(["run"] if fmt == "draftsmith" else [])]
    )


def test_a_layout_is_never_written_over_its_own_source(capsys, tmp_path, medusa_export):
    import shutil

    export = shutil.copytree(medusa_export, tmp_path / "EXPORT")
    before = tree_snapshot(export)
    line = cli_error_line(
        capsys, ["export", str(export), "--out", str(export), "--format", "medusa"]
    )
    assert f"--out {export} is the source {export}" in line and "choose another --out" in line
    line = cli_error_line(
        capsys, ["export", str(export), "--out", str(tmp_path), "--format", "medusa-tgi"]
    )
    assert "is a folder holding the source" in line
    assert tree_snapshot(export) == before
    assert json.loads((export / "config.json").read_text())["format"] == "draftsmith"


def test_an_earlier_export_is_replaced_but_not_one_holding_the_users_files(
    capsys, tmp_path, medusa_export
):
    out = tmp_path / "vllm"
    for _ in range(2):  # the second run replaces the first one's layout
        assert main(["export", str(medusa_export), "--out", str(out), "--format", "medusa"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "vllm"
    ]  # no temporary or old folder left beside it
    (out / "notes.txt").write_text("the user's")
    line = cli_error_line(
        capsys, ["export", str(medusa_export), "--out", str(out), "--format", "medusa"]
    )
    assert "also holds files draftsmith did not write (notes.txt)" in line
    assert (out / "notes.txt").read_text() == "the user's" and (out / "model.safetensors").is_file()


def test_a_file_where_the_folder_goes_is_refused_and_kept(tmp_path):
    target = tmp_path / "out"
    target.write_text("a file of the user's")
    with pytest.raises(OutputRefused, match="is a file, not a folder"):
        write_folder(target, lambda tmp: (tmp / "report.json").write_text("{}"), PLAIN)
    assert target.read_text() == "a file of the user's"


def test_an_empty_folder_or_a_missing_one_is_written(tmp_path):
    (tmp_path / "empty").mkdir()
    for name in ("empty", "new"):
        out = write_folder(
            tmp_path / name, lambda tmp: (tmp / "report.json").write_text("{}"), PLAIN
        )
        assert sorted(p.name for p in out.iterdir()) == ["report.json"]


def test_stale_temporaries_of_a_dead_process_are_removed_with_a_warning(tmp_path, caplog):
    dead, out = dead_pid(), tmp_path / "out"
    stale = tmp_path / f".out.tmp-{dead}-x1y2"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    # a live pid's temporary is a write in progress
    live = tmp_path / f".out.tmp-{os.getpid() + 0}-mine"
    live.mkdir()
    with caplog.at_level(logging.WARNING):
        write_folder(out, lambda tmp: (tmp / "report.json").write_text("{}"), PLAIN)
    assert not stale.exists() and live.exists()
    assert (
        f"removing {stale}, left by an earlier write that did not finish (process {dead} is gone)"
        in caplog.text
    )


def test_a_swap_stopped_between_its_renames_is_put_back(tmp_path, caplog):
    old = tmp_path / f".out.old-{dead_pid()}"
    old.mkdir()
    (old / "report.json").write_text('{"run": 1}')
    with pytest.raises(RuntimeError, match="fill failed"):
        write_folder(
            tmp_path / "out", lambda tmp: (_ for _ in ()).throw(RuntimeError("fill failed")), PLAIN
        )
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == {
        "run": 1
    }  # restored, then kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failed_fill_leaves_the_previous_folder_and_no_temporary(tmp_path):
    out = write_folder(tmp_path / "out", lambda tmp: (tmp / "report.json").write_text("1"), PLAIN)

    def broken(tmp: Path) -> None:
        (tmp / "report.json").write_text("2")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_folder(out, broken, PLAIN)
    assert (out / "report.json").read_text() == "1" and sorted(
        p.name for p in tmp_path.iterdir()
    ) == ["out"]


def test_write_file_is_atomic_and_refuses_what_it_does_not_own(tmp_path):
    path = write_file(tmp_path / "bench.json", '{"a": 1}\n')
    with pytest.raises(ValueError, match="boom"):
        write_file(
            path, lambda tmp: (tmp.write_text("half"), (_ for _ in ()).throw(ValueError("boom")))
        )
    assert path.read_text() == '{"a": 1}\n' and sorted(p.name for p in tmp_path.iterdir()) == [
        "bench.json"
    ]
    (tmp_path / "notes.md").write_text("user")
    with pytest.raises(OutputRefused, match="was not written by draftsmith"):
        write_file(tmp_path / "notes.md", "x", owned=lambda p: p.read_text().startswith("{"))
    assert (tmp_path / "notes.md").read_text() == "user"


def test_check_folder_target_fails_before_the_work(tmp_path):
    users_folder(tmp_path / "mine")
    with pytest.raises(OutputRefused, match="is not a draftsmith report"):
        check_folder_target(tmp_path / "mine", PLAIN)
    assert check_folder_target(tmp_path / "fresh", PLAIN) == (tmp_path / "fresh").resolve()


def test_a_scratch_folder_is_removed_and_a_killed_ones_is_cleaned_later(tmp_path):
    with scratch_folder(tmp_path / "out") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(f".out.tmp-{os.getpid()}-")
    assert not tmp.exists()
    left = tmp_path / f".out.tmp-{dead_pid()}-abc"
    left.mkdir()
    write_export(
        tmp_path / "out",
        {"w": torch.zeros(2)},
        {"method": "medusa", "architecture": {}, "target": {"name_or_path": "t"}},
    )
    assert not left.exists() and EXPORT_OUTPUT.recognize(tmp_path / "out")


# ---- GGUF: the drafter's name and the tools `make llamacpp` builds -------------------------------


def built_tools() -> set[str]:
    """The tools scripts/build_llamacpp.sh builds by default (its TARGETS line)."""
    script = (ROOT / "scripts" / "build_llamacpp.sh").read_text()
    return set(re.search(r"TARGETS=\$\{LLAMACPP_TARGETS:-([^}]*)\}", script).group(1).split())


def test_draft_gguf_is_named_after_the_drafter_not_a_temporary_folder(tmp_path, monkeypatch):
    from draftsmith.export import gguf

    export = write_export(
        tmp_path / "exp",
        {"w": torch.zeros(2)},
        {
            "method": "eagle3",
            "architecture": {"target_layers": [1, 2, 3]},
            "target": {"name_or_path": "t"},
        },
    )
    seen: list[list[str]] = []

    def fake_converter(argv, **_):
        seen.append(argv)
        Path(argv[argv.index("--outfile") + 1]).write_bytes(b"GGUF")
        return subprocess.CompletedProcess(argv, 0, "", "")

    def fake_input(export_dir, out_dir, target_dir):
        out_dir.mkdir(parents=True)
        return json.loads((Path(export_dir) / "config.json").read_text())

    monkeypatch.setattr(gguf.subprocess, "run", fake_converter)
    monkeypatch.setattr(gguf, "converter_input", fake_input)
    (tmp_path / "target.gguf").write_bytes(b"GGUF")
    out = gguf.to_gguf(
        export, tmp_path / "gguf", tmp_path, tmp_path, target_gguf=tmp_path / "target.gguf"
    )
    model_dir = Path(
        seen[0][2]
    )  # convert_hf_to_gguf.py MODEL_DIR: llama.cpp's general.name comes from its name
    assert model_dir.name == "draftsmith-eagle3-drafter" and "tmp" not in model_dir.name
    manifest = json.loads((out / "gguf.json").read_text())
    assert manifest["run"].split()[0] in built_tools()
    assert "llama-server" not in built_tools() and "builds none" in manifest["serve"]
    assert sorted(p.name for p in out.iterdir()) == ["draft.gguf", "gguf.json", "target-bf16.gguf"]


def test_docs_and_the_gguf_docstring_name_only_tools_that_are_built():
    from draftsmith.export import gguf

    engines = (ROOT / "docs" / "ENGINES.md").read_text()
    commands = re.findall(r"# llama\.cpp: (\S+)", engines)
    assert commands and set(commands) <= built_tools()
    assert (
        "llama.cpp: llama-server" not in engines and "Serve with ``llama-server" not in gguf.__doc__
    )
    for text in (
        engines,
        gguf.__doc__,
    ):  # where llama-server is named, the text says `make llamacpp` builds none
        assert re.search(r"(builds|and) no\s+`+llama-server", " ".join(text.split())), text[:200]


def test_an_output_under_a_file_is_refused_before_any_work(tmp_path):
    from draftsmith.common.atomic_folder import check_file_target

    (tmp_path / "blocker").write_text("a file of the user's")
    with pytest.raises(OutputRefused, match=f"cannot write .*: {tmp_path / 'blocker'} is a file"):
        check_file_target(tmp_path / "blocker" / "out" / "bench.json")
    assert check_file_target(tmp_path / "new" / "bench.json") == tmp_path / "new" / "bench.json"
    assert not (tmp_path / "new").exists()  # a check creates nothing
