"""Every test file has one tier in tests/conftest.py's TIERS, and every collected test carries exactly one tier marker
(unit, integration or e2e), so that `make test-fast`, `make test-integration` and `make test-e2e` together run what
`make test` runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import conftest
import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
ANY_TIER_BUT_ONE = " or ".join(
    [" and ".join(f"not {t}" for t in conftest.TIER_MARKERS)]
    + [f"{a} and {b}" for i, a in enumerate(conftest.TIER_MARKERS) for b in conftest.TIER_MARKERS[i + 1:]])


def tiers_of(item: pytest.Item) -> list[str]:
    return [tier for tier in conftest.TIER_MARKERS if item.get_closest_marker(tier) is not None]


def test_the_tier_table_names_every_test_file_and_only_those():
    files = {path.name for path in TESTS.glob("test_*.py")}
    missing, stale = sorted(files - set(conftest.TIERS)), sorted(set(conftest.TIERS) - files)
    assert not missing, f"give these files a tier in tests/conftest.py TIERS: {missing}"
    assert not stale, f"TIERS names files that do not exist (renamed or removed?): {stale}"
    assert set(conftest.TIERS.values()) <= set(conftest.TIER_MARKERS)


def test_every_collected_test_has_exactly_one_tier(request):
    """Checked on this session's collection when it covers every file (``make test``, ``make test-fast``: ``-m``
    only deselects), else on a ``--collect-only`` of tests/ in a subprocess (when this file runs on its own)."""
    collected = list(request.session.items) + list(conftest.DESELECTED)
    if {item.path.name for item in collected} >= set(conftest.TIERS):
        wrong = [f"{item.nodeid}: {tiers_of(item) or 'no tier'}" for item in collected if len(tiers_of(item)) != 1]
    else:
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               "--continue-on-collection-errors", "-m", ANY_TIER_BUT_ONE, str(TESTS)],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert "error" not in proc.stdout.splitlines()[-1], proc.stdout[-3000:]  # the summary line
        wrong = [line for line in proc.stdout.splitlines() if "::" in line]
    assert not wrong, f"tests with no tier or several ({ANY_TIER_BUT_ONE}): {wrong}"


def test_an_explicit_tier_on_a_test_wins_over_its_files(pytester):
    """The hook on a small suite: a unit file's integration/e2e tests keep their own tier, slow/gpu marks stay."""
    text = (TESTS / "conftest.py").read_text()
    hook = text[text.index("TIERS = {"): text.index("@pytest.fixture(autouse=True")]  # the table and the hooks
    pytester.makeconftest("import pytest\n\n" + hook.replace(
        "TIERS = {", 'TIERS = {"test_mixed.py": "unit", "test_whole.py": "e2e",', 1))
    pytester.makepyfile(
        test_mixed="""
            import pytest

            def test_plain(): pass

            @pytest.mark.integration
            def test_embedded(): pass

            @pytest.mark.e2e
            @pytest.mark.slow
            def test_subprocess(): pass
        """,
        test_whole="""
            import pytest

            pytestmark = pytest.mark.gpu

            def test_run(): pass
        """,
        test_untiered="def test_lost(): pass\n",
    )
    pytester.makeini("[pytest]\nmarkers =\n    unit\n    integration\n    e2e\n    slow\n    gpu\n")
    selected = {}
    for expr in ("unit", "integration", "e2e", "slow", "gpu", ANY_TIER_BUT_ONE):
        result = pytester.runpytest("--collect-only", "-q", "-p", "no:cacheprovider", "-m", expr)
        selected[expr] = sorted(line.split("::")[1] for line in result.outlines if "::" in line)
    assert selected == {"unit": ["test_plain"], "integration": ["test_embedded"],
                        "e2e": ["test_run", "test_subprocess"], "slow": ["test_subprocess"], "gpu": ["test_run"],
                        ANY_TIER_BUT_ONE: ["test_lost"]}
