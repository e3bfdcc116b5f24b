"""The one write rule (issue 50): no command writes over a file or folder it did not create, nor
into, over or around what it reads; a place that cannot be written is refused before the work, in
one line (common/write_rule.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from export_faults import cli_error_line, tree_snapshot

from draftsmith.cli import main
from draftsmith.common.atomic_folder import (
    OutputRefused,
    check_output_file,
    check_writable,
    refuse_overlap,
    run_folder_problem,
)
from draftsmith.datagen import regenerate as regen

pytestmark = pytest.mark.unit

SMALL = ["--limit", "2", "--max-new-tokens", "2", "--dtype", "fp32", "--batch-size", "1"]


@pytest.fixture()
def nothing_loads(monkeypatch):
    """Fail the test if a command gets as far as loading a model (every refusal here comes
    before)."""
    from draftsmith.runtime import serving

    def loaded(*args, **kwargs):
        raise AssertionError("the command loaded a model before refusing")

    monkeypatch.setattr(serving, "load_runtime", loaded)


def test_regenerate_out_equal_to_data_is_refused_and_the_data_kept(
    capsys, nothing_loads, tmp_path, tiny_data_file, tiny_target_dir
):
    """`regenerate --data X --out X` used to replace the user's dataset by the regenerated one."""
    data = Path(shutil.copy(tiny_data_file, tmp_path / "chat.jsonl"))
    before = data.read_bytes()
    line = cli_error_line(
        capsys,
        [
            "regenerate",
            "--data",
            str(data),
            "--out",
            str(data),
            "--target",
            str(tiny_target_dir),
            *SMALL,
        ],
    )
    assert f"--out {data} is the input {data}" in line and "nothing was written" in line
    assert data.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "chat.jsonl"
    ]


def test_regenerate_never_replaces_an_existing_file_without_overwrite(
    capsys, nothing_loads, tmp_path, tiny_data_file, tiny_target_dir
):
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"mine": true}\n')
    line = cli_error_line(
        capsys,
        [
            "regenerate",
            "--data",
            str(tiny_data_file),
            "--out",
            str(mine),
            "--target",
            str(tiny_target_dir),
            *SMALL,
        ],
    )
    assert f"--out {mine} exists" in line and "--overwrite" in line
    assert mine.read_text() == '{"mine": true}\n' and not Path(f"{mine}.partial").exists()


def test_regenerate_overwrite_replaces_it(tmp_path, tiny_data_file, tiny_target_dir):
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    assert (
        main(
            [
                "regenerate",
                "--data",
                str(tiny_data_file),
                "--out",
                str(out),
                "--target",
                str(tiny_target_dir),
                "--overwrite",
                *SMALL,
            ]
        )
        == 0
    )
    assert out.read_text() != "old\n" and "source_index" in out.read_text()


def test_regenerate_out_that_is_a_folder_is_refused_before_any_work(
    capsys, nothing_loads, tmp_path, tiny_data_file, tiny_target_dir
):
    """It used to regenerate everything, then fail with "[Errno 21] Is a directory" and leave
    DIR.partial."""
    folder = tmp_path / "dir"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    line = cli_error_line(
        capsys,
        [
            "regenerate",
            "--data",
            str(tiny_data_file),
            "--out",
            str(folder),
            "--target",
            str(tiny_target_dir),
            *SMALL,
        ],
    )
    assert f"--out {folder} is a folder" in line
    assert not Path(f"{folder}.partial").exists() and (folder / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("where", ["drafter", "inside-target"])
def test_bench_out_never_writes_into_an_input(
    capsys, nothing_loads, tmp_path, medusa_export, tiny_target_dir, where
):
    export = shutil.copytree(medusa_export, tmp_path / "export")
    target = shutil.copytree(tiny_target_dir, tmp_path / "target")
    out = export if where == "drafter" else target / "bench"
    before = tree_snapshot(tmp_path)
    line = cli_error_line(
        capsys, ["bench", "--drafter", str(export), "--target", str(target), "--out", str(out)]
    )
    assert f"--out {out} is " in line and "nothing was written" in line
    assert tree_snapshot(tmp_path) == before


def test_bench_out_of_the_users_is_refused(capsys, nothing_loads, tmp_path, medusa_export):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    line = cli_error_line(capsys, ["bench", "--drafter", str(medusa_export), "--out", str(mine)])
    assert "is not a draftsmith bench output (it holds notes.txt)" in line


def test_overlap_in_each_direction():
    refuse_overlap("/a/b", ["/c"])  # unrelated: fine
    for out, given, how in (
        ("/a/b", "/a/b", "is the"),
        ("/a/b/c", "/a/b", "is inside the"),
        ("/a", "/a/b/x.jsonl", "is a folder holding the"),
    ):
        with pytest.raises(OutputRefused, match=how):
            refuse_overlap(out, [given])
    refuse_overlap("/a", ["/a/b/x.jsonl"], containing=False)  # a file output cannot hold anything


def test_check_writable_names_a_file_parent_and_a_read_only_place(tmp_path, monkeypatch):
    blocker = tmp_path / "f"
    blocker.write_text("x")
    with pytest.raises(OutputRefused, match=f"{blocker} is a file, not a folder"):
        check_writable(blocker / "sub" / "out")
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(OutputRefused, match="cannot be written: .* no write permission|read-only"):
        check_writable(tmp_path / "new")


def test_check_output_file(tmp_path):
    out = tmp_path / "o.jsonl"
    assert check_output_file(out) == out.resolve()
    out.write_text("x")
    with pytest.raises(OutputRefused, match="exists: nothing was written or replaced"):
        check_output_file(out)
    check_output_file(out, overwrite=True)
    check_output_file(out, owned=lambda p: True)


def test_run_folder_problems(tmp_path, tiny_target_dir, tiny_data_file):
    blocker = tmp_path / "f"
    blocker.write_text("x")
    users = tmp_path / "users"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    data = tmp_path / "d" / "a.jsonl"
    data.parent.mkdir()
    shutil.copy(tiny_data_file, data)
    cases = {
        str(blocker): "is a file",
        str(blocker / "run"): "is a file, not a folder",
        str(users): "is not a draftsmith run folder",
        str(tiny_target_dir): "is the input",
        str(data.parent): "is a folder holding the input",
    }
    for run_dir, problem in cases.items():
        found = run_folder_problem(
            [
                f"hydra.run.dir={run_dir}",
                f"data.spec={data}",
                f"target.name_or_path={tiny_target_dir}",
            ]
        )
        assert (
            found is not None and problem in found and found.startswith(f"hydra.run.dir {run_dir}")
        ), found
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    # a run folder: it resumes
    assert run_folder_problem([f"hydra.run.dir={run}", f"data.spec={data}"]) is None
    assert run_folder_problem([f"hydra.run.dir={tmp_path / 'new'}"]) is None
    assert run_folder_problem(["recipe=medusa"]) is None


def test_train_refuses_a_run_dir_that_is_a_file_in_one_line(tmp_path, capsys, monkeypatch):
    """hydra.run.dir=FILE used to end in Hydra's traceback."""
    import sys

    from draftsmith.train import run_command_line

    blocker = tmp_path / "f"
    blocker.write_text("x")
    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(SystemExit) as ended:
        run_command_line(["recipe=medusa", f"hydra.run.dir={blocker}"], "train.py")
    assert ended.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: hydra.run.dir {blocker} is a file, not a folder: nothing was written; choose"
        " another hydra.run.dir"
    ]
    assert blocker.read_text() == "x"


@pytest.mark.parametrize("command", ["curve", "cache-features"])
def test_an_out_that_is_a_file_is_one_line_not_a_traceback(capsys, tmp_path, command, monkeypatch):
    """`curve --out FILE` and `cache-features --out FILE` used to end in tracebacks."""
    blocker = tmp_path / "f"
    blocker.write_text("x")
    extra = ["--steps", "2", "--first-steps", "1", "--points", "1"] if command == "curve" else []
    code = main([command, "--out", str(blocker), *extra, "recipe=medusa"])
    err = capsys.readouterr().err
    assert code in (1, 2) and "Traceback" not in err and f"--out {blocker} is a file" in err, err
    assert blocker.read_text() == "x"


def test_cache_features_shard_mb_zero_is_refused(capsys, tmp_path):
    """docs/ERRORS.md said it is; it was not."""
    with pytest.raises(SystemExit) as ended:
        main(["cache-features", "--out", str(tmp_path / "c"), "--shard-mb", "0", "recipe=eagle3"])
    assert ended.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("draftsmith cache-features: error: --shard-mb must be > 0, got 0"), err


def test_regenerate_function_keeps_the_rule(tmp_path, tiny_data_file):
    with pytest.raises(OutputRefused, match="is the input"):
        regen.regenerate(str(tiny_data_file), tiny_data_file)


def test_a_full_disk_while_regenerating_is_one_line_and_keeps_the_lines(tmp_path, monkeypatch):
    """A full disk while appending to OUT.partial used to be a traceback."""
    import errno
    import json

    from draftsmith.common.atomic_folder import DiskFullError
    from draftsmith.datagen import resumable_jsonl

    partial = tmp_path / "o.jsonl.partial"
    with open(partial, "a", encoding="utf-8") as handle:
        resumable_jsonl.append_line(handle, {"source_index": 0})

        def full(fd):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(resumable_jsonl.os, "fsync", full)
        with pytest.raises(
            DiskFullError,
            match=f"no space left on the device for {partial}: .* every complete line is kept",
        ):
            resumable_jsonl.append_line(handle, {"source_index": 1})
    assert json.loads(partial.read_text().splitlines()[0]) == {"source_index": 0}
