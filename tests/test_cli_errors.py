"""One error base and one failure policy (issue 51): every error class the project raises on purpose
derives from ``DraftsmithError`` (and keeps its builtin type); the CLI prints one line for those,
and for anything else the traceback and a line saying it is a bug; Ctrl-C is one line and exit
130."""

from __future__ import annotations

import ast
import importlib
import io
import os
from pathlib import Path

import pytest

from draftsmith.cli import main
from draftsmith.cli import serving as serving_cli
from draftsmith.common.errors import DraftsmithError, InputError, report_failure

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
NOT_ERRORS = {
    "TrainingInterrupted"
}  # a KeyboardInterrupt: Ctrl-C, reported with the command that resumes


def exception_classes() -> list[tuple[str, str]]:
    """(module, class) of every class in the source tree whose bases name an exception type."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".venv", ".cache", "scripts", "docs") or rel.parts[
            0
        ].startswith("."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                word in ast.unparse(b)
                for b in node.bases
                for word in (
                    "Error",
                    "Exception",
                    "Refused",
                    "Unavailable",
                    "Missing",
                    "Unsupported",
                )
            ):
                module = "draftsmith." + ".".join(rel.with_suffix("").parts)
                found.append((module, node.name))
    return found


def test_the_walk_finds_the_error_classes():
    names = {name for _, name in exception_classes()}
    assert {"ExportError", "OutputRefused", "WeightsError", "CurveError", "AssetError"} <= names


@pytest.mark.parametrize("module,name", exception_classes())
def test_every_error_class_derives_from_the_one_base(module, name):
    cls = getattr(importlib.import_module(module), name)
    if name in NOT_ERRORS:
        assert issubclass(cls, KeyboardInterrupt)
        return
    assert issubclass(cls, DraftsmithError), f"{module}.{name} does not derive from DraftsmithError"


def _failing(monkeypatch, err: BaseException) -> None:
    def handler(args):
        raise err

    monkeypatch.setitem(serving_cli.HANDLERS, "generate", handler)
    for key in ("DRAFTSMITH_TRACEBACK", "DRAFTSMITH_DEBUG"):
        # setenv first so teardown removes what `--traceback` sets in os.environ (delenv of an unset
        # key records nothing to undo, and the leaked variable made later tests' train.py print
        # tracebacks)
        monkeypatch.setenv(key, "0")
        monkeypatch.delenv(key)


def test_a_purposeful_error_is_one_line_exit_2(monkeypatch, capsys):
    _failing(monkeypatch, InputError("--prompt x is\nnot usable"))
    assert main(["generate", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "draftsmith generate: error: --prompt x is not usable"


def test_traceback_on_request_keeps_the_line(monkeypatch, capsys):
    _failing(monkeypatch, InputError("bad input"))
    assert main(["generate", "--prompt", "hi", "--traceback"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().endswith("error: bad input")
    # the flag was this run's: the next in-process run is one line again (it leaked into every later
    # test)
    assert "DRAFTSMITH_TRACEBACK" not in os.environ
    assert main(["generate", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.strip() == "draftsmith generate: error: bad input"


def test_a_bug_prints_its_traceback_and_says_it_is_a_bug(monkeypatch, capsys):
    """A plain ValueError from deep inside used to read `error: ...` like a user's mistake."""
    _failing(monkeypatch, ValueError("index 3 out of range"))
    assert main(["generate", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ValueError: index 3 out of range" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        "draftsmith generate: internal error (ValueError): this is a bug in draftsmith"
    )
    assert "report it" in last


def test_ctrl_c_is_one_line_exit_130(monkeypatch, capsys):
    _failing(monkeypatch, KeyboardInterrupt())
    assert main(["generate", "--prompt", "hi"]) == 130
    err = capsys.readouterr().err
    assert (
        len(err.strip().splitlines()) == 1
        and "interrupted (Ctrl-C)" in err
        and "Traceback" not in err
    )


def test_report_failure_policy_as_train_uses_it(monkeypatch):
    monkeypatch.delenv("DRAFTSMITH_TRACEBACK", raising=False)
    monkeypatch.delenv("DRAFTSMITH_DEBUG", raising=False)
    out = io.StringIO()
    assert report_failure(InputError(""), "train.py", user_exit=1, stream=out) == 1
    assert out.getvalue() == "train.py: error: InputError\n"
    out = io.StringIO()
    try:
        raise KeyError("x")
    except KeyError as err:
        assert report_failure(err, "train.py", stream=out) == 1
    assert "Traceback" in out.getvalue() and "internal error (KeyError)" in out.getvalue()


def test_builtin_types_are_kept_for_callers_that_catch_them():
    from draftsmith.common.atomic_folder import DiskFullError, OutputRefused
    from draftsmith.export.format import ExportError

    assert issubclass(OutputRefused, ValueError) and issubclass(DiskFullError, OSError)
    assert issubclass(ExportError, RuntimeError) and issubclass(InputError, ValueError)


def test_help_says_how_to_get_a_traceback(capsys):
    assert main(["--help"]) == 0
    assert "--traceback" in capsys.readouterr().out
