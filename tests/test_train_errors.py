"""train.py's errors: a purposeful error (config, data, template, cache, export, asset...) is one
``error:`` line and exit 1, and HYDRA_FULL_ERROR=1 shows it whole; a bug keeps its traceback;
preemption exits 143; a bad data file is one line from a real ``python train.py``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from test_training_guards import run_train

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _error_classes() -> dict[str, type[BaseException]]:
    """Every error class draftsmith raises on purpose for the user to read, by name."""
    from draftsmith.assets import AssetError
    from draftsmith.common import errors
    from draftsmith.distill.data.samples import TemplateError
    from draftsmith.distill.engine.callbacks.guards import NonFiniteLossError
    from draftsmith.distill.feature_cache.manifest import FeatureCacheError
    from draftsmith.export.format import ExportError, TargetMismatchError

    return {
        cls.__name__: cls
        for cls in (
            errors.ConfigError,
            errors.DataError,
            errors.DataFileNotFoundError,
            errors.MissingDependencyError,
            TemplateError,
            FeatureCacheError,
            NonFiniteLossError,
            ExportError,
            TargetMismatchError,
            AssetError,
        )
    }


def _train_main_raising(
    err: BaseException, tmp_path: Path, monkeypatch, full_error: bool = False
) -> int | None:
    """Run train.py as a script, in-process, with training replaced by ``raise err``; its exit
    status."""
    import runpy

    from draftsmith.distill.engine import trainer

    def failing_train(*args, **kwargs):
        raise err

    monkeypatch.setattr(trainer, "train", failing_train)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "train.py",
            "recipe=medusa",
            f"hydra.run.dir={tmp_path}",
            "hydra.output_subdir=null",
            "hydra/job_logging=none",
            "hydra/hydra_logging=none",
        ],
    )
    if full_error:
        monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    else:
        monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as ended:
        runpy.run_path(
            str(ROOT / "train.py"), run_name="__main__"
        )  # as `python train.py ...` runs it
    return ended.value.code


@pytest.mark.parametrize(
    "name",
    [
        "ConfigError",
        "DataError",
        "DataFileNotFoundError",
        "MissingDependencyError",
        "TemplateError",
        "FeatureCacheError",
        "NonFiniteLossError",
        "ExportError",
        "TargetMismatchError",
        "AssetError",
    ],
)
def test_train_reports_a_purposeful_error_as_one_line_and_exit_1(
    name, tmp_path, monkeypatch, capsys
):
    cls = _error_classes()[name]
    assert _train_main_raising(cls(f"{name} happened:\n  see   line 2"), tmp_path, monkeypatch) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: {name} happened: see line 2"], err[-3000:]
    # HYDRA_FULL_ERROR=1 lets the same error through, with its type, for a full traceback.
    with pytest.raises(cls, match=f"{name} happened"):
        _train_main_raising(cls(f"{name} happened"), tmp_path, monkeypatch, full_error=True)


@pytest.mark.parametrize(
    "bug",
    [ValueError("plain value error"), RuntimeError("plain runtime error"), KeyError("missing key")],
    ids=lambda e: type(e).__name__,
)
def test_train_keeps_the_traceback_of_an_error_outside_the_purposeful_set(
    bug, tmp_path, monkeypatch, capsys
):
    # A builtin error of the same base type as a purposeful one is a bug: Hydra reports it with its
    # traceback.
    assert _train_main_raising(bug, tmp_path, monkeypatch) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and f"{type(bug).__name__}: " in err and str(bug) in err, err[-3000:]
    assert not any(line.startswith("error: ") for line in err.splitlines()), err[-3000:]


def test_train_reports_preemption_with_exit_143(tmp_path, monkeypatch, capsys):
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    assert _train_main_raising(SIGTERMException(), tmp_path, monkeypatch) == 143
    lines = capsys.readouterr().err.splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("error: preempted by SIGTERM")
        and "resume" in lines[0]
    ), lines


@pytest.mark.e2e  # a train.py / draftsmith subprocess
def test_bad_data_file_prints_one_error_line(tmp_path, tiny_target_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value":'
        ' "yo"}]}\n{oops\n'
    )
    args = (
        "recipe=medusa",
        f"target={tiny_target_dir}",
        "target.dtype=fp32",
        f"data={bad}",
        "trainer.max_steps=1",
    )
    env = {"DRAFTSMITH_CACHE": str(tmp_path / "cache")}
    proc = run_train(*args, f"hydra.run.dir={tmp_path / 'a'}", env=env)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr, proc.stderr[
        -3000:
    ]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.search(r"bad\.jsonl:2: invalid JSON", errors[0]), proc.stderr[
        -3000:
    ]
    full = run_train(*args, f"hydra.run.dir={tmp_path / 'b'}", env={**env, "HYDRA_FULL_ERROR": "1"})
    assert full.returncode != 0 and "Traceback" in full.stderr and "DataError" in full.stderr
