"""Every test file declares one tier (a ``pytestmark`` line after its imports, or a folder named
after the tier), and every collected test carries exactly one tier marker (unit, integration or
e2e), so that `make test-fast`, `make test-integration` and `make test-e2e` together run what `make
test` runs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import conftest
import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
ANY_TIER_BUT_ONE = " or ".join(
    [" and ".join(f"not {t}" for t in conftest.TIER_MARKERS)]
    + [
        f"{a} and {b}"
        for i, a in enumerate(conftest.TIER_MARKERS)
        for b in conftest.TIER_MARKERS[i + 1 :]
    ]
)


def tiers_of(item: pytest.Item) -> list[str]:
    return [tier for tier in conftest.TIER_MARKERS if item.get_closest_marker(tier) is not None]


def test_files() -> list[Path]:
    """Every file pytest collects under tests/ (``test_*.py`` at any depth)."""
    return sorted(TESTS.rglob("test_*.py"))


test_files.__test__ = False  # a helper, not a test


def declared_tiers(path: Path, root: Path = TESTS) -> list[str]:
    """The tiers a test file declares: ``pytest.mark.<tier>`` in its module-level ``pytestmark``,
    else its folder's."""
    marks = []
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(target, ast.Name) and target.id == "pytestmark" for target in targets):
            marks += [
                sub.attr
                for sub in ast.walk(node.value)
                if isinstance(sub, ast.Attribute)
                and sub.attr in conftest.TIER_MARKERS
                and ast.unparse(sub.value) == "pytest.mark"
            ]
    folder = conftest.folder_tier(path.relative_to(root))
    return marks or ([folder] if folder else [])


def test_every_test_file_declares_exactly_one_tier():
    wrong = {str(path.relative_to(TESTS)): declared_tiers(path) for path in test_files()}
    wrong = {name: tiers for name, tiers in wrong.items() if len(tiers) != 1}
    assert not wrong, (
        "give each test file one tier after its imports, e.g. `pytestmark = pytest.mark.unit` (see "
        f"tests/conftest.py, test tiers): {wrong}"
    )


def test_the_declaration_check_sees_a_missing_and_a_double_tier(tmp_path):
    cases = {
        "test_none.py": "import pytest\n\npytestmark = pytest.mark.slow\n",
        "test_two.py": "import pytest\n\npytestmark = [pytest.mark.unit, pytest.mark.e2e]\n",
        "test_one.py": "import pytest\n\npytestmark = [pytest.mark.gpu, pytest.mark.integration]\n",
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    found = {name: declared_tiers(tmp_path / name, tmp_path) for name in cases}
    assert found == {
        "test_none.py": [],
        "test_two.py": ["unit", "e2e"],
        "test_one.py": ["integration"],
    }
    assert (
        conftest.folder_tier(Path("e2e/test_x.py")) == "e2e"
        and conftest.folder_tier(Path("test_x.py")) is None
    )


def test_every_collected_test_has_exactly_one_tier(request):
    """Checked on this session's collection when it covers every file (``make test``, ``make
    test-fast``: ``-m`` only deselects), else on a ``--collect-only`` of tests/ in a subprocess
    (when this file runs on its own).
    """
    collected = list(request.session.items) + list(conftest.DESELECTED)
    if {item.path for item in collected} >= set(test_files()):
        wrong = [
            f"{item.nodeid}: {tiers_of(item) or 'no tier'}"
            for item in collected
            if len(tiers_of(item)) != 1
        ]
    else:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "--collect-only",
                "-q",
                "-p",
                "no:cacheprovider",
                "--continue-on-collection-errors",
                "-m",
                ANY_TIER_BUT_ONE,
                str(TESTS),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert "error" not in proc.stdout.splitlines()[-1], proc.stdout[-3000:]  # the summary line
        wrong = [line for line in proc.stdout.splitlines() if "::" in line]
    assert not wrong, f"tests with no tier or several ({ANY_TIER_BUT_ONE}): {wrong}"


def test_an_explicit_tier_on_a_test_wins_over_its_files(pytester):
    """The hook on a small suite: a unit file's integration/e2e tests keep their own tier, a folder
    gives its tier, slow/gpu marks stay, and a file without a tier leaves its tests without one."""
    lines = (TESTS / "conftest.py").read_text().splitlines(keepends=True)
    start = next(
        i
        for i, line in enumerate(lines)
        if line.startswith("# -") and line.rstrip().endswith(" test tiers")
    )
    end = next(i for i, line in enumerate(lines) if line.rstrip().endswith(" end of test tiers"))
    hooks = "".join(lines[start:end])
    pytester.makeconftest(
        "from __future__ import annotations\n\nfrom pathlib import Path\n\nimport pytest\n\n"
        + hooks
    )
    pytester.makepyfile(
        test_mixed="""
            import pytest

            pytestmark = pytest.mark.unit

            def test_plain(): pass

            @pytest.mark.integration
            def test_embedded(): pass

            @pytest.mark.e2e
            @pytest.mark.slow
            def test_subprocess(): pass

            @pytest.mark.e2e
            class TestWhole:
                def test_in_class(self): pass
        """,
        test_whole="""
            import pytest

            pytestmark = [pytest.mark.e2e, pytest.mark.gpu]

            def test_run(): pass
        """,
        test_untiered="def test_lost(): pass\n",
    )
    (pytester.path / "integration").mkdir()
    (pytester.path / "integration" / "test_placed.py").write_text("def test_by_folder(): pass\n")
    pytester.makeini("[pytest]\nmarkers =\n    unit\n    integration\n    e2e\n    slow\n    gpu\n")
    selected = {}
    for expr in ("unit", "integration", "e2e", "slow", "gpu", ANY_TIER_BUT_ONE):
        result = pytester.runpytest("--collect-only", "-q", "-p", "no:cacheprovider", "-m", expr)
        selected[expr] = sorted(line.split("::")[-1] for line in result.outlines if "::" in line)
    assert selected == {
        "unit": ["test_plain"],
        "integration": ["test_by_folder", "test_embedded"],
        "e2e": ["test_in_class", "test_run", "test_subprocess"],
        "slow": ["test_subprocess"],
        "gpu": ["test_run"],
        ANY_TIER_BUT_ONE: ["test_lost"],
    }
