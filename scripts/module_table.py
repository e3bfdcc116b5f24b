"""Print docs/ARCHITECTURE.md's "Every module" table from the filesystem, or rewrite it in place with --write.

    python scripts/module_table.py            # print the table
    python scripts/module_table.py --write    # replace the table in docs/ARCHITECTURE.md

One row per ``*.py`` outside tests/ and scripts/ (and the C++ kernel), its purpose from the module docstring's
first sentence. tests/test_docs.py fails when the table and the files disagree.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
SKIP = {".venv", ".git", ".cache", "tests", "scripts", "outputs", "multirun", "build"}
HEADER = "| module | purpose |\n|---|---|\n"


def modules() -> list[Path]:
    """Every module the table lists, relative to the repository root, sorted top level first."""
    found = [p.relative_to(ROOT) for p in ROOT.rglob("*.py") if not SKIP & set(p.relative_to(ROOT).parts)]
    found += [p.relative_to(ROOT) for p in (ROOT / "kernels").glob("*.cpp")]
    return sorted(found, key=lambda p: (len(p.parts) > 1, str(p)))


def purpose(path: Path) -> str:
    """The first sentence of the module's docstring (the C++ kernel: its first comment line)."""
    text = (ROOT / path).read_text()
    if path.suffix == ".cpp":
        first = next((line.strip("/ ") for line in text.splitlines() if line.startswith("//")), "")
        return first or "C++ kernel"
    doc = ast.get_docstring(ast.parse(text)) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    sentence = re.split(r"(?<=\.)\s", first, maxsplit=1)[0].rstrip(".")
    return sentence.replace("|", "\\|") or "(no docstring)"


def table(kept: dict[str, str] | None = None) -> str:
    """The markdown table; ``kept`` (module -> purpose) keeps rows written by hand."""
    kept = kept or {}
    return HEADER + "".join(f"| `{p}` | {kept.get(str(p)) or purpose(p)} |\n" for p in modules())


def rows(doc: str) -> dict[str, str]:
    """Module path -> purpose of every row of the document's table."""
    start = doc.index(HEADER)
    lines = doc[start + len(HEADER):].split("\n\n", 1)[0].splitlines()
    return {line.split("`")[1]: line.split("` | ", 1)[1].rsplit(" |", 1)[0] for line in lines if line.startswith("| `")}


def listed(doc: str) -> list[str]:
    """Module paths the document's table lists."""
    return list(rows(doc))


def main() -> None:
    """Print or rewrite the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="replace the table in docs/ARCHITECTURE.md")
    args = parser.parse_args()
    if not args.write:
        print(table(), end="")
        return
    doc = DOC.read_text()
    start = doc.index(HEADER)
    end = start + len(HEADER) + len(doc[start + len(HEADER):].split("\n\n", 1)[0]) + 1
    DOC.write_text(doc[:start] + table(rows(doc)) + doc[end:])


if __name__ == "__main__":
    main()
