"""docs/ADDING_A_METHOD.md is true: the toy method placed in a copy of the repository touches
exactly the files and rooms the guide counts (one line in each list it names), breaks none of the
checks that read those lists, and is composed through Hydra, trained one step, exported and served
losslessly as a user would."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
GIT = ["git", "-c", "user.name=toy", "-c", "user.email=toy@example.invalid"]

# ----------------------------------------------------------------------------------- the toy's diff
# The checks that read the lists a method could have to be added to: the method table, tiers, rooms,
# docs, house rules and the proposer contract (where it exists).
CHECKS = [
    "tests/test_method_table.py",
    "tests/test_tiers.py",
    "tests/test_rooms.py",
    "tests/test_docs.py",
    "tests/test_house_rules.py",
    "tests/test_proposer_contract.py",
]
TOY_TEST = "tests/test_toy.py"
# ADDING_A_METHOD.md's count of what adding the toy touches
CLAIM = re.compile(r"\*\*(\d+) files in (\d+) rooms\*\*")


def copy_of_the_repository(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The repository's files (tracked, or untracked and not ignored) in ``tmp_path/draftsmith``,
    and the environment that makes ``import draftsmith`` load the copy."""
    repo = tmp_path / "draftsmith"
    for rel in subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split():
        if (ROOT / rel).is_file():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, repo / rel)
    # `import draftsmith` must load the copy, not the installed checkout
    package = tmp_path / "site"
    package.mkdir()
    (package / "draftsmith").symlink_to(repo, target_is_directory=True)
    return repo, {
        **os.environ,
        "PYTHONPATH": str(package),
        "DRAFTSMITH_CACHE": str(tmp_path / "cache"),
    }


def failing(repo: Path, env: dict[str, str], tests: list[str]) -> set[str]:
    """The node ids of ``tests`` that fail or error in ``repo`` (the training and whole-suite
    collection left out)."""
    if not tests:
        return set()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rfE",
            "-m",
            "not e2e and not integration",
            "-k",
            "not trains_exports_and_drafts and not every_collected_test",
            *tests,
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    found = {
        line.split()[1]
        for line in proc.stdout.splitlines()
        if line.startswith(("FAILED ", "ERROR "))
    }
    # e.g. a collection crash
    assert proc.returncode == 0 or found, proc.stdout[-3000:] + proc.stderr[-2000:]
    return found


def run(repo: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args], cwd=repo, capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def committed_copy(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A copy of the repository with its generated tables current, committed as the base the toy's
    changes are read against; the copy and its environment."""
    repo, env = copy_of_the_repository(tmp_path)
    # the copy's generated tables brought up to date first: the check is about what the toy changes
    subprocess.run(
        [sys.executable, "docs/tools/module_table.py", "--write"], cwd=repo, env=env, check=True
    )
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        subprocess.run([*GIT, *args], cwd=repo, check=True, capture_output=True)
    return repo, env


def check_the_toys_diff(repo: Path, toy_method) -> None:
    """The toy changed exactly its placed files and one line in each list, as many files and rooms
    as ADDING_A_METHOD.md counts."""
    status = subprocess.run(
        [*GIT, "status", "--porcelain", "--untracked-files=all"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    changed = sorted(line[3:] for line in status)
    assert changed == sorted([*toy_method.PLACED, *toy_method.LISTED])
    files, rooms = map(
        int, CLAIM.search((ROOT / "docs" / "ADDING_A_METHOD.md").read_text()).groups()
    )
    assert (len(changed), len({Path(p).parts[0] for p in changed})) == (files, rooms)
    # one name added to each list (one entry a line): one line added, nothing else changed
    for listed in toy_method.LISTED:
        diff = subprocess.run(
            [*GIT, "diff", "--numstat", "--", listed],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert diff[:2] == ["1", "0"], (listed, diff)


def failing_because_of_the_toy(repo: Path, env: dict[str, str]) -> set[str]:
    """The list-reading checks and the toy's own tests that fail with the toy placed and passed
    without it."""
    checks = [c for c in CHECKS if (repo / c).is_file()]
    new = failing(repo, env, [*checks, TOY_TEST])
    # what already fails without the toy (someone's work in progress) is not the toy's doing
    if new:
        subprocess.run([*GIT, "stash", "-u", "-q"], cwd=repo, check=True)  # the private copy only
        new -= failing(repo, env, sorted(n for n in new if not n.startswith(TOY_TEST)))
        subprocess.run([*GIT, "stash", "pop", "-q"], cwd=repo, check=True)
    return new


def train_the_toy(repo: Path, env: dict[str, str], run_dir: Path, target: Path, data: Path):
    """One training step of ``recipe=toy`` on the tiny target, composed through Hydra by
    train.py, its export written under ``run_dir``."""
    run(
        repo,
        env,
        "train.py",
        "recipe=toy",
        f"target={target}",
        "target.dtype=fp32",
        f"data={data}",
        "data.limit=null",
        "data.max_length=48",
        "data.batch_size=4",
        "data.val_fraction=0.1",
        "trainer.max_steps=1",
        "run.checkpoint_every=1",
        "run.final_eval_batches=1",
        "validation.served_tau.every=0",
        f"hydra.run.dir={run_dir}",
    )


# pytest subprocesses over the list-reading checks, a training run and two generations in a copy
@pytest.mark.e2e
def test_adding_the_toy_method_touches_the_files_the_guide_counts_and_it_trains_and_serves(
    tmp_path, tiny_target_dir, tiny_data_file
):
    import toy_method

    if shutil.which("git") is None:
        pytest.skip("no git on this machine")
    repo, env = committed_copy(tmp_path)
    toy_method.place(repo)
    check_the_toys_diff(repo, toy_method)
    new = failing_because_of_the_toy(repo, env)
    assert not new, (
        "with only the toy's files and its two names added, these fail (a list to edit?):"
        f" {sorted(new)}"
    )
    assert "`toy`" in run(repo, env, "docs/tools/method_footprint.py").stdout
    # composed through Hydra, trained, exported and served, as a user would
    run_dir = tmp_path / "run"
    train_the_toy(repo, env, run_dir, tiny_target_dir, tiny_data_file)
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["method"] == "toy" and config["training"]["steps"] == 1
    generate = [
        "-m",
        "draftsmith.cli",
        "generate",
        "--prompt",
        "hello world",
        "--max-new-tokens",
        "8",
        "--dtype",
        "fp32",
        "--target",
        str(tiny_target_dir),
    ]
    served = run(repo, env, *generate, "--drafter", str(run_dir / "export"))
    plain = run(repo, env, *generate)
    # lossless: greedy, fp32
    assert "tau" in served.stderr and served.stdout.strip() == plain.stdout.strip()
