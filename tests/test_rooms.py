"""The room rules of docs/ARCHITECTURE.md, enforced by parsing every import (lazy ones inside
functions too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("pytorch_lightning", "lightning", "hydra", "omegaconf")

# room -> module prefixes it must never import (the table in docs/ARCHITECTURE.md)
TRAINING = ("draftsmith.distill", "draftsmith.recipes")
MEASURING = ("draftsmith.bench", "draftsmith.datagen", "draftsmith.evals", "draftsmith.cli")
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "common": (
        *FRAMEWORKS,
        *TRAINING,
        *MEASURING,
        "draftsmith.heads",
        "draftsmith.drafters",
        "draftsmith.controllers",
        "draftsmith.runtime",
        "draftsmith.kernels",
        "draftsmith.export",
    ),
    "heads": (*FRAMEWORKS, *TRAINING, *MEASURING, "draftsmith.runtime", "draftsmith.drafters"),
    "drafters": (*FRAMEWORKS, *TRAINING, *MEASURING, "draftsmith.runtime", "draftsmith.heads"),
    "controllers": (*FRAMEWORKS, *TRAINING, *MEASURING, "draftsmith.runtime"),
    "export": (*FRAMEWORKS, *TRAINING, *MEASURING, "draftsmith.runtime"),
    "kernels": (*FRAMEWORKS, *TRAINING, *MEASURING, "draftsmith.runtime"),
    # runtime/ serves and nothing else: no training, measurement, data production or CLI code
    "runtime": (*FRAMEWORKS, *TRAINING, *MEASURING),
    # bench/ measures the runtime; it never reaches into data producers or evaluations (they import
    # it)
    "bench": (*FRAMEWORKS, *TRAINING, "draftsmith.datagen", "draftsmith.evals", "draftsmith.cli"),
    # datagen/ produces training data with the runtime; distill/ imports its readers, never the
    # reverse
    "datagen": (*FRAMEWORKS, *TRAINING, "draftsmith.bench", "draftsmith.evals", "draftsmith.cli"),
    "evals": (*FRAMEWORKS, *TRAINING, "draftsmith.cli"),
    # training never imports serving or measurement code: what both need lives in common/
    "distill": (
        "hydra",
        "draftsmith.recipes",
        "draftsmith.runtime",
        "draftsmith.bench",
        "draftsmith.evals",
        "draftsmith.cli",
    ),
    "recipes": ("draftsmith.runtime", "draftsmith.bench", "draftsmith.evals", "draftsmith.cli"),
    "assets.py": (*FRAMEWORKS, *TRAINING, *MEASURING, "draftsmith.runtime"),
}
MAY_IMPORT_RECIPES = {"train.py", "cli", "recipes"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)] + [
                (node.lineno, f"{node.module}.{a.name}") for a in node.names
            ]
    return found


def sources(room: str) -> list[Path]:
    target = ROOT / room
    return [target] if target.is_file() else sorted(target.rglob("*.py"))


def hits(path: Path, banned: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for line, name in imported_modules(path)
        if any(name == b or name.startswith(b + ".") for b in banned)
    ]


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_imports_follow_the_table(room):
    problems = [h for path in sources(room) for h in hits(path, FORBIDDEN[room])]
    assert not problems, "room rule broken (see docs/ARCHITECTURE.md):\n" + "\n".join(problems)


def test_nothing_but_the_entry_points_imports_recipes():
    tops = [p for p in ROOT.glob("*.py")] + [
        p
        for d in ROOT.iterdir()
        if d.is_dir() and (d / "__init__.py").exists()
        for p in d.rglob("*.py")
    ]
    problems = [
        h
        for p in tops
        if p.relative_to(ROOT).parts[0] not in MAY_IMPORT_RECIPES
        for h in hits(p, ("draftsmith.recipes",))
    ]
    assert not problems, "\n".join(problems)


def test_the_checker_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    from omegaconf import OmegaConf\n    import"
        " draftsmith.distill.target.frozen\n"
    )
    assert [n for _, n in imported_modules(module)] == [
        "omegaconf",
        "omegaconf.OmegaConf",
        "draftsmith.distill.target.frozen",
    ]


def test_each_data_folder_format_is_written_down_once():
    """A folder format's file names live in its datagen/<name>_folder.py, which both the writer
    (datagen/) and the reader training uses (distill/) import; a second copy would drift (it once
    did: META and ROWS twice).
    """
    import re

    defined = [
        f"{p.relative_to(ROOT)}:{m.group(1)}"
        for room in ("datagen", "distill")
        for p in sources(room)
        for m in re.finditer(r"^(META|ROWS|SHARD)\b[^=\n]*=", p.read_text(), re.M)
    ]
    assert defined and all("_folder.py:" in d for d in defined), defined
