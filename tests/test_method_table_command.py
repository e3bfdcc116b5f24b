"""``draftsmith method-table``: its help, its one-line refusals, and the table it writes and resumes
(the stages are faked: each ``draftsmith`` subprocess writes what the real one would, so nothing
trains here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.cli import main
from draftsmith.evals import method_table

pytestmark = pytest.mark.unit


def refused(capsys, argv: list[str]) -> str:
    """``argv`` exits 2 with exactly one line on stderr (no usage block, no traceback)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "usage:" not in err, (
        err
    )
    return err.strip()


def test_help_lists_the_options(capsys):
    assert main(["method-table", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--recipes", "--steps", "--out", "--bench-args", "--default-bench"):
        assert flag in out


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--recipes", "medusa,nope"], "unknown recipe 'nope'"),
        (["--recipes", ","], "--recipes names no recipe"),
        (["--steps", "0"], "--steps"),
        (["--recipes", "medusa", "--default-bench", "eagle3"], "eagle3 not in --recipes"),
        (["--colour"], "unrecognized arguments: --colour"),
    ],
)
def test_bad_options_are_refused_in_one_line(capsys, tmp_path, monkeypatch, argv, says):
    monkeypatch.setattr(method_table.subprocess, "call", pytest.fail)  # nothing may run
    line = refused(capsys, ["method-table", *argv, "--out", str(tmp_path / "t")])
    assert says in line, line
    assert not (tmp_path / "t").exists()


def test_an_out_folder_of_the_users_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(method_table.subprocess, "call", pytest.fail)
    (tmp_path / "notes.txt").write_text("mine")
    line = refused(capsys, ["method-table", "--recipes", "medusa", "--out", str(tmp_path)])
    assert "is not a draftsmith method table" in line, line
    assert (tmp_path / "notes.txt").read_text() == "mine"


BENCH = {
    "tau": 2.5,
    "acceptance_by_position": [0.8, 0.5],
    "tokens_per_s": {"speculative": 30.0, "runtime_ar": 20.0},
    "speedup": {"vs_runtime_ar": 1.5},
    "lossless": True,
    "inference": {"stop_policy": {"spec": "fixed:2"}},
}


def fake_stage(calls: list[list[str]]):
    """A ``subprocess.call`` that records each stage and writes the output the real stage would."""

    def call(cmd: list[str], stdout, stderr) -> int:
        args = cmd[3:]  # after `python -m draftsmith.cli`
        calls.append(args)
        if args[0] == "train":
            run_dir = Path(next(a for a in args if a.startswith("hydra.run.dir=")).split("=", 1)[1])
            (run_dir / "export").mkdir(parents=True)
            training = {"steps": 4, "tokens": 4096, "fit_seconds": 12.0}
            (run_dir / "export" / "config.json").write_text(json.dumps({"training": training}))
        elif args[0] == "bench-train":
            out = Path(args[args.index("--out") + 1])
            out.write_text(json.dumps({"trainable_params_m": 1.5, "ratio": 0.5}))
        else:  # bench export
            out = Path(args[args.index("--out") + 1])
            out.mkdir(parents=True)
            (out / "bench.json").write_text(json.dumps(BENCH))
        return 0

    return call


def test_the_table_is_written_and_a_rerun_runs_no_stage_again(capsys, tmp_path, monkeypatch):
    calls: list[list[str]] = []
    monkeypatch.setattr(method_table.subprocess, "call", fake_stage(calls))
    out = tmp_path / "table"
    argv = ["method-table", "--recipes", "medusa,eagle3@trainer.lr=1e-3", "--steps", "4"]
    assert main([*argv, "--default-bench", "medusa", "--out", str(out)]) == 0
    stages = [(c[0], c[1]) for c in calls]
    assert stages == [
        ("train", "recipe=medusa"),
        ("bench-train", "recipe=medusa"),
        ("bench", "export"),
        ("bench", "export"),  # medusa's default-settings bench
        ("train", "recipe=eagle3"),
        ("bench-train", "recipe=eagle3"),
        ("bench", "export"),
    ]
    assert "trainer.max_steps=4" in calls[0] and "trainer.lr=1e-3" in calls[4]
    rows = json.loads((out / "table.json").read_text())
    assert [r["recipe"] for r in rows] == ["medusa", "eagle3@trainer.lr=1e-3"]
    assert rows[0]["method"] == "Medusa-1" and rows[1]["method"].endswith("(trainer.lr=1e-3)")
    assert rows[0]["default_speedup_vs_ar"] == 1.5 and rows[1]["default_speedup_vs_ar"] is None
    assert rows[0]["extra_params"] == 1.5e6 and rows[0]["tokens"] == 4096
    assert "| Medusa-1 | 2.500 |" in (out / "table.md").read_text()
    assert (out / "table.png").read_bytes()[:4] == b"\x89PNG"
    calls.clear()
    assert main([*argv, "--default-bench", "medusa", "--out", str(out)]) == 0
    assert calls == []  # every stage's output is there: the table is re-read, nothing re-runs
    assert json.loads((out / "table.json").read_text()) == rows


def test_a_failed_stage_is_one_line_naming_its_log(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(method_table.subprocess, "call", lambda cmd, stdout, stderr: 3)
    line = refused(capsys, ["method-table", "--recipes", "medusa", "--out", str(tmp_path / "t")])
    assert "train recipe=medusa" in line and "failed (3)" in line and "train.log" in line, line
