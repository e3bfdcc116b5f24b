"""Write README.md's command list from the CLI's own tables: ``COMMANDS`` (cli/__init__.py) and the
bench modes (``MODES``, cli/bench_modes.py).

    python docs/tools/readme_commands.py            # print the list
    python docs/tools/readme_commands.py --write    # rewrite it in README.md
    python docs/tools/readme_commands.py --check    # exit 1 when README.md's list is stale

The list sits between ``<!-- generated: commands -->`` and ``<!-- end generated: commands -->`` in
README.md and is never edited by hand; a command registered in ``COMMANDS`` appears there at the
next ``--write``, and tests/test_docs.py fails until it does. What each command does is the commands
table of docs/ARCHITECTURE.md (docs/tools/module_table.py) and ``draftsmith COMMAND --help``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from module_table import (
    ROOT,
    begin,
    end,
    part,
    replace_part,
)  # noqa: E402 - the generated-part fences, shared

README = ROOT / "README.md"
PART = "commands"
WIDTH = 118


def command_list() -> str:
    """The README's command list: every ``draftsmith`` command in ``COMMANDS`` order, then the bench
    modes."""
    cli = importlib.import_module("draftsmith.cli")
    modes = importlib.import_module("draftsmith.cli.bench_modes").MODES
    names = ", ".join(f"`{name}`" for name in cli.COMMANDS)
    mode_words = ", ".join(
        f"`bench {mode}`" + (" (the default)" if i == 0 else "") for i, mode in enumerate(modes)
    )
    text = (
        "Commands (console script `draftsmith`; `python train.py` is `draftsmith train`; each"
        f" takes `--help`): {names}. The bench takes a mode: {mode_words}; `bench MODE --help`"
        " lists its flags. What each command does: the commands table of `docs/ARCHITECTURE.md`."
    )
    return wrap(text)


def wrap(text: str) -> str:
    """``text`` in lines of at most WIDTH characters, never breaking inside a code span (a span
    split over two lines reads wrong to the doc checks of tests/test_docs.py)."""
    spans = text.split("`")
    glued = "`".join(
        s.replace(" ", "\0") if i % 2 else s for i, s in enumerate(spans)
    )  # odd pieces: code spans
    lines = textwrap.wrap(glued, WIDTH, break_on_hyphens=False, break_long_words=False)
    return "".join(line.replace("\0", " ") + "\n" for line in lines)


def stale(doc: str) -> bool:
    """Whether ``doc``'s command list differs from the CLI's tables."""
    return part(doc, PART) != command_list()


def main() -> int:
    """Print, check (``--check``: exit 1 when stale) or rewrite (``--write``) README.md's command
    list."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument(
        "--write",
        dest="action",
        action="store_const",
        const="write",
        help="rewrite it in README.md",
    )
    action.add_argument(
        "--check",
        dest="action",
        action="store_const",
        const="check",
        help="exit 1 when it is stale",
    )
    doc, wanted = README.read_text(), command_list()
    match parser.parse_args().action:
        case "check":
            print(
                "stale: README.md's command list (python docs/tools/readme_commands.py --write)"
                if stale(doc)
                else "current"
            )
            return int(stale(doc))
        case "write":
            README.write_text(replace_part(doc, PART, wanted))
        case _:
            print(f"{begin(PART)}{wanted}{end(PART)}", end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
