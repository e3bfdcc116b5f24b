"""The docs match the code: ARCHITECTURE.md lists every module, no doc points outside the repository, and the
Makefile's train-best trains on what it regenerates."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _module_table():
    spec = importlib.util.spec_from_file_location("module_table", ROOT / "scripts" / "module_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_architecture_lists_every_module_and_no_other():
    mt = _module_table()
    on_disk = {str(p) for p in mt.modules()}
    in_doc = set(mt.listed(mt.DOC.read_text()))
    assert not on_disk - in_doc, f"modules missing from docs/ARCHITECTURE.md: {sorted(on_disk - in_doc)} " \
                                 "(python scripts/module_table.py --write)"
    assert not in_doc - on_disk, f"docs/ARCHITECTURE.md lists modules that do not exist: {sorted(in_doc - on_disk)}"


def test_no_doc_points_outside_the_repository():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    offenders = [str(d.relative_to(ROOT)) for d in docs if "../shared" in d.read_text() or "DESIGN.md" in d.read_text()]
    assert not offenders, f"docs that point outside the repository: {offenders}"


def test_readme_stays_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines; measurement logs belong in docs/MEASUREMENTS.md"


def test_train_best_trains_on_every_regenerated_conversation():
    """`make train-best` regenerates BEST_CONVERSATIONS and must train on all of them: the data config's default
    `limit: 2000` silently cut an 8,000-conversation run to its first 2,000 (found on 2026-11-26)."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    dry = subprocess.run(["make", "-n", "train-best", "BEST_PRECISION=32-true", "BEST_CONVERSATIONS=123"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    train = next(line for line in dry.splitlines() if "train.py recipe=eagle3" in line)
    assert "data=outputs/best/regen123_code1300.jsonl" in train and "data.limit=null" in train, train
    # the chat set (the first 123 conversations) and the coding set past them are regenerated, then joined
    regen = [line for line in dry.splitlines() if "draftsmith regenerate" in line]
    assert any("--out outputs/best/regen123.jsonl --limit 123 " in line for line in regen), regen
    assert any("--topic code --skip 123 --limit 1300" in line for line in regen), regen
    assert "cat outputs/best/regen123.jsonl outputs/best/regen_code1300.jsonl > " in dry, dry
