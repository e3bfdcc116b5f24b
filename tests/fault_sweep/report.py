"""The sweep's table: clean % and the count of each outcome class, by command and by owner, then
every case that is not clean with its owner and reason (``results.md``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from classify import CLASSES, GOOD


def command_of(record: dict) -> str:
    """``bench``, ``regenerate``, ``train``... of a case's command line."""
    words = record["cmd"].split()
    return "train.py" if words[0] == "train" else words[1] if len(words) > 1 else words[0]


def _row(name: str, records: list[dict]) -> str:
    counts = Counter(r["outcome"] for r in records)
    good = sum(counts[c] for c in GOOD)
    return (
        f"| {name} | {len(records)} | {100 * good / max(len(records), 1):.1f}% | "
        + " | ".join(str(counts[c] or "") for c in CLASSES)
        + " |"
    )


def summary_table(results: list[dict], key) -> list[str]:
    """Markdown rows of the outcome counts grouped by ``key(record)`` (skipped cases left out),
    total first."""
    ran = [r for r in results if r["outcome"] != "skipped"]
    groups: dict[str, list[dict]] = {}
    for record in ran:
        groups.setdefault(key(record), []).append(record)
    head = [
        "| | cases | clean % | " + " | ".join(CLASSES) + " |",
        "|---" * (len(CLASSES) + 3) + "|",
    ]
    return head + [_row("**all**", ran)] + [_row(name, groups[name]) for name in sorted(groups)]


def write_report(results: list[dict], path: Path) -> str:
    """Write ``path`` and return its text."""
    skipped = [r for r in results if r["outcome"] == "skipped"]
    bad = [r for r in results if r["outcome"] not in (*GOOD, "skipped")]
    lines = [
        "# Fault sweep",
        "",
        "clean: refused in one line naming what it must, or (controls) worked.",
        "",
        "## By command",
        "",
        *summary_table(results, command_of),
        "",
        "## By owner",
        "",
        *summary_table(results, lambda r: r["owner"]),
        "",
        f"## Not clean ({len(bad)})",
        "",
        "| case | owner | outcome | reason |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['id']} | {r['owner']} | {r['outcome']} | {r['reason'][:160].replace('|', '/')} |"
        for r in bad
    ]
    if skipped:
        lines += [
            "",
            f"Skipped ({len(skipped)}): "
            + ", ".join(f"{r['id']} ({r['reason']})" for r in skipped),
        ]
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


START, END = "<!-- fault-sweep:start -->", "<!-- fault-sweep:end -->"


def _shown(text: str, places: dict[str, str]) -> str:
    """``text`` with the world's and the scratch folders' paths put back as placeholders (longest
    first)."""
    for name, path in sorted(places.items(), key=lambda kv: -len(kv[1])):
        text = text.replace(path, "{" + name + "}")
    return text.replace("|", "/")


def docs_block(results: list[dict], places: dict[str, str], cases_dir: str) -> str:
    """The markdown table docs/ERRORS.md keeps between its fault-sweep markers: every case, its
    command, owner, outcome and the one line the user saw (or why it is not clean)."""
    lines = [
        START,
        "",
        "\n".join(summary_table(results, command_of)),
        "",
        "| case | command | owner | outcome | what the user sees |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        scratch = {**places, "S": f"{cases_dir}/{r['id']}"}
        said = (
            r["reason"] if r["outcome"] in ("clean", "ok") else f"**{r['outcome']}**: {r['reason']}"
        )
        lines.append(
            f"| {r['id']} | `{_shown(r['cmd'], {})}` | {r['owner']} | {r['outcome']} | "
            f"{_shown(said, scratch)[:240]} |"
        )
    return "\n".join(lines + ["", END])


def write_docs(results: list[dict], places: dict[str, str], cases_dir: str, doc: Path) -> None:
    """Replace the block between the markers of ``doc`` (docs/ERRORS.md) with :func:`docs_block`."""
    text = doc.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    doc.write_text(head + docs_block(results, places, cases_dir) + tail)
