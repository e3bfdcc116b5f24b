"""The docs match the code: the generated parts of ARCHITECTURE.md are current, every path, `make`
target, `draftsmith` command and recipe the README and docs/*.md name exists, no doc points outside
the repository, and the Makefile's train-best trains on what it regenerates. That adding the toy
method touches the files ADDING_A_METHOD.md counts: tests/test_adding_a_method.py."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `draftsmith X` where a command line starts (a code span or line, after `$ `, `&& `, `; `, `| `,
# `(`, a venv's bin/ or environment settings), not inside a quoted message ("not a draftsmith
# drafter export").
COMMAND = re.compile(r"(?:^|&&|;|\||\(|\$ |bin/)\s*(?:[A-Z_]+=\S*\s+)*draftsmith\s+([a-z][\w-]*)")
PLACEHOLDER = re.compile(
    r"[<>*{}$|]|\.\.\.|[A-Z]{3,}"
)  # `runtime/drafting/<family>.py`, `OUT/x`, globs


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------- what a doc claims exists
def code_spans(text: str) -> list[str]:
    """Inline code spans and the lines of fenced code blocks: where a doc names paths and
    commands."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", prose) + [
        line for block in fenced for line in block.splitlines()
    ]


def repository_roots() -> set[str]:
    """Top-level names of the files git tracks or would track (not outputs/, .venv/: those a run
    makes)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return {Path(p).parts[0] for p in listed}


def named_paths(span: str, roots: set[str]) -> list[str]:
    """Words of a code span that read as a repository path: they start with a top-level folder or
    file, name no placeholder, and end in a file suffix or a slash, or are the whole span
    (``runtime/target/model.py``, ``tests/``, ``Makefile``, ``tests/unit``; not ``bench/generate``
    in ``draftsmith bench/generate --drafter``).
    """
    words = [w.strip("(),;:'\"").removeprefix("./").split("::")[0] for w in span.split()]
    return [
        w
        for w in words
        if w
        and not PLACEHOLDER.search(w)
        and "=" not in w
        and Path(w).parts
        and Path(w).parts[0] in roots
        and (Path(w).suffix or w.endswith("/") or w == span.strip())
    ]


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {
        t
        for line in re.findall(r"^([A-Za-z0-9_.\- ]+):(?!=)", text, flags=re.M)
        for t in line.split()
    }


def claims(doc: Path, roots: set[str]) -> dict[str, set[str]]:
    """Kind -> the names ``doc`` uses: repository paths, `make` targets, `draftsmith` commands,
    recipes, links."""
    # the fault sweep's generated table quotes bad inputs on purpose (recipe=banana, missing files):
    # not claims
    text = re.sub(
        r"<!-- fault-sweep:start -->.*?<!-- fault-sweep:end -->", "", doc.read_text(), flags=re.S
    )
    found: dict[str, set[str]] = {
        "path": set(),
        "make": set(),
        "command": set(),
        "recipe": set(),
        "link": set(),
    }
    for span in code_spans(text):
        found["path"].update(named_paths(span, roots))
        found["make"].update(
            re.findall(r"(?:^|[\s;&(])make\s+(?:-\S+\s+)*([a-z][\w-]*)(?![\w=-])", span)
        )
        found["command"].update(re.findall(COMMAND, span))
        found["recipe"].update(re.findall(r"\brecipe=([a-z][a-z0-9_]*)\b", span))
    for link in re.findall(r"\]\(([^)#\s]+)", text):
        if "://" not in link and not link.startswith("mailto:"):
            found["link"].add(link)
    return found


def missing(
    doc: Path, roots: set[str], targets: set[str], commands: set[str], recipes: set[str]
) -> list[str]:
    """What ``doc`` names that does not exist."""
    found = claims(doc, roots)
    out = [f"path {p}" for p in sorted(found["path"]) if not (ROOT / p).exists()]
    out += [f"link {link}" for link in sorted(found["link"]) if not (doc.parent / link).exists()]
    out += [f"`make {t}` (no such Makefile target)" for t in sorted(found["make"] - targets)]
    out += [f"`draftsmith {c}` (not in cli COMMANDS)" for c in sorted(found["command"] - commands)]
    out += [f"recipe={r} (no conf/recipe/{r}.yaml)" for r in sorted(found["recipe"] - recipes)]
    return out


def the_code() -> tuple[set[str], set[str], set[str], set[str]]:
    from draftsmith.cli import COMMANDS

    recipes = {p.stem for p in (ROOT / "conf" / "recipe").glob("*.yaml")}
    return repository_roots(), makefile_targets(), set(COMMANDS), recipes


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_path_target_command_and_recipe_a_doc_names_exists(doc):
    roots, targets, commands, recipes = the_code()
    assert missing(doc, roots, targets, commands, recipes) == [], (
        f"{doc.relative_to(ROOT)} names what does not exist"
    )


def test_the_doc_check_sees_what_does_not_exist(tmp_path):
    roots, targets, commands, recipes = the_code()
    doc = tmp_path / "STALE.md"
    doc.write_text(
        "`make test-fast` runs `tests/unit`; `make nope`; see `runtime/target/model.py`,"
        " `Makefile`, `runtime/drafting/<family>.py` and [x](nowhere.md).\n\n```bash\ndraftsmith"
        " bench --drafter X\ndraftsmith frobnicate\npython train.py recipe=medusa\npython train.py"
        " recipe=medusa9\n```\n"
    )
    assert missing(doc, roots, targets, commands, recipes) == [
        "path tests/unit",
        "link nowhere.md",
        "`make nope` (no such Makefile target)",
        "`draftsmith frobnicate` (not in cli COMMANDS)",
        "recipe=medusa9 (no conf/recipe/medusa9.yaml)",
    ]


# ---------------------------------------------------------------------- generated parts of the docs
def test_the_generated_parts_of_architecture_are_current():
    mt = _script("module_table")
    assert mt.stale(mt.DOC.read_text()) == [], "run `python docs/tools/module_table.py --write`"


def test_a_stale_part_is_seen():
    mt = _script("module_table")
    doc = mt.DOC.read_text()
    for name, text in mt.generated(doc).items():  # today's parts, whatever the page says
        doc = mt.replace_part(doc, name, text)
    assert mt.stale(doc) == []
    assert mt.stale(doc.replace("| `common/chat.py` |", "| `common/chat_old.py` |")) == ["modules"]
    without_row = "".join(
        line for line in doc.splitlines(keepends=True) if not line.startswith("| `common/chat.py`")
    )
    assert mt.stale(without_row) == ["modules"]
    owned = "".join(
        line for line in doc.splitlines(keepends=True) if not line.startswith("| `heads/hydra.py`")
    )
    assert mt.stale(owned) == []  # a method's own file may wait for the next --write
    new_method = "".join(
        line for line in doc.splitlines(keepends=True) if not line.startswith("| `hydra_pp` |")
    )
    assert mt.stale(new_method) == []  # and so may a new method's footprint row
    assert mt.stale(doc.replace("| `hydra_pp` | 4 |", "| `hydra_pp` | 5 |")) == ["footprint"]
    assert mt.stale(doc.replace("| `engine-check` |", "| `engine-checks` |")) == ["commands"]


def test_the_readme_command_list_is_every_registered_command():
    """README's command list is generated from the CLI's tables (docs/tools/readme_commands.py); it
    once lacked `import`, `engine-check` and `curve` and gave the diffusion bench's old form."""
    from draftsmith.cli import COMMANDS
    from draftsmith.cli.bench_modes import MODES

    rc = _script("readme_commands")
    doc = rc.README.read_text()
    assert not rc.stale(doc), "run `python docs/tools/readme_commands.py --write`"
    listed = set(re.findall(r"`([a-z][\w-]*)`", rc.part(doc, rc.PART)))
    assert {"import", "engine-check", "curve", "flagship"} <= set(COMMANDS)
    assert set(COMMANDS) <= listed, (
        f"commands missing from README: {sorted(set(COMMANDS) - listed)}"
    )
    assert all(f"`bench {mode}`" in rc.part(doc, rc.PART) for mode in MODES)


def test_a_stale_command_list_is_seen():
    rc = _script("readme_commands")
    doc = rc.replace_part(rc.README.read_text(), rc.PART, rc.command_list())
    assert not rc.stale(doc)
    assert rc.stale(doc.replace("`engine-check`, ", ""))  # a registered command left out
    assert rc.stale(doc.replace("`curve`", "`curves`"))
    wrapped = rc.wrap(
        "word " * 22 + "`a code span across the line's end` and words after it"
    )  # span at column 110
    # no span split over two lines
    assert all(line.count("`") % 2 == 0 for line in wrapped.splitlines()), wrapped


def test_docs_name_the_bench_mode():
    """`draftsmith bench --flag` still runs (the mode read off its flags), but the docs say the
    mode. ARCHITECTURE.md is generated (its module rows are docstrings, its data paths
    docs/tools/room_walk.py's traced command).
    """
    modeless = re.compile(r"draftsmith bench (?=--|\\)")
    written = [d for d in DOCS if d.name != "ARCHITECTURE.md"]
    offenders = [
        f"{d.relative_to(ROOT)}:{n}"
        for d in [*written, ROOT / "Makefile"]
        for n, line in enumerate(d.read_text().splitlines(), 1)
        if modeless.search(line)
    ]
    assert not offenders, (
        f"name the mode (draftsmith bench export|controller|reward|diffusion): {offenders}"
    )


def test_no_doc_points_outside_the_repository():
    offenders = [
        str(d.relative_to(ROOT))
        for d in DOCS
        if "../shared" in d.read_text() or "DESIGN.md" in d.read_text()
    ]
    assert not offenders, f"docs that point outside the repository: {offenders}"
    outside = re.compile(
        r"\bshared/research|\.\./shared|/work/"
    )  # lpo.py once cited "shared/research"
    sources = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    cited = [
        p for p in sources if p != "tests/test_docs.py" and outside.search((ROOT / p).read_text())
    ]
    assert not cited, f"source files that cite a path outside the repository: {cited}"


def test_readme_stays_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 300, (
        f"README.md has {lines} lines; measurement logs belong in docs/notebook/MEASUREMENTS.md"
    )


def test_the_slow_marker_says_what_the_default_run_does():
    """pyproject.toml once called `slow` opt-in while nothing deselected it: its description and
    addopts agree."""
    text = (ROOT / "pyproject.toml").read_text()
    description = re.search(r'"slow: ([^"]*)"', text).group(1)
    deselected = "not slow" in re.search(r'^addopts = "([^"]*)"', text, flags=re.M).group(1)
    assert ("opt-in" in description) == deselected, (
        f"slow: {description!r}, deselected by default: {deselected}"
    )
    assert ("run by default" in description) == (not deselected), description


def test_train_best_trains_on_every_regenerated_conversation(tmp_path):
    """`make train-best` regenerates BEST_CONVERSATIONS and must train on all of them: the data
    config's default
    `limit: 2000` silently cut an 8,000-conversation run to its first 2,000 (found on 2026-11-26).
    """
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    dry = subprocess.run(
        [
            "make",
            "-n",
            "train-best",
            "BEST_PRECISION=32-true",
            "BEST_CONVERSATIONS=123",
            "BEST_COMPARE=",
            "BEST_SOURCE=regen",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    train = next(line for line in dry.replace("\\\n", " ").splitlines() if "flagship train" in line)
    assert "data=outputs/best/regen123_code1300.jsonl" in train and "data.limit=null" in train, (
        train
    )
    # the chat set (the first 123 conversations) and the coding set past them are regenerated, then
    # joined
    regen = [
        line for line in dry.replace("\\\n", " ").splitlines() if "draftsmith regenerate" in line
    ]
    assert any("--out outputs/best/regen123.jsonl --limit 123 " in line for line in regen), regen
    code = next(line for line in regen if "--topic code" in line)
    assert "--limit 1300" in code and "--max-prompt-tokens" in code, code
    # the coding set starts past the chat set's last source record (its kept 123 may reach past
    # index 123)
    skip = code.split("--skip ", 1)[1].split(" --limit", 1)[0]
    chat = tmp_path / "regen123.jsonl"
    chat.write_text(
        "".join(json.dumps({"messages": [], "source_index": i}) + "\n" for i in (0, 5, 140))
    )
    shell = subprocess.run(
        ["bash", "-c", f"echo {skip.replace('outputs/best/regen123.jsonl', str(chat))}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert shell.stdout.strip() == "141", (skip, shell.stdout, shell.stderr)
    assert "cat outputs/best/regen123.jsonl outputs/best/regen_code1300.jsonl > " in dry, dry
