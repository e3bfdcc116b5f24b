"""The data paths of docs/ARCHITECTURE.md, traced: the functions a training run's data and a bench's
data pass through.

    .venv/bin/python docs/tools/room_walk.py            # print both paths
    .venv/bin/python docs/tools/room_walk.py --write  # rewrite docs/ARCHITECTURE.md's data path
    .venv/bin/python docs/tools/room_walk.py --json

Definition (what tests/test_room_walk.py keeps true):
- each command runs in a fresh interpreter under ``sys.setprofile`` (main thread), on a tiny
  in-process Llama target (tests/conftest.py builds it): ``python train.py recipe=eagle3 ...`` for 2
  steps, which writes ``<run>/export``, then ``draftsmith bench --drafter <run>/export ...
  --stop-policy export`` on one prompt (the export's own draft shape: the cost-aware default chooses
  one from timings, and a path that depends on timings cannot be checked);
- a call is kept when its function lies in the repository (not tests/, scripts/, module bodies) and
  is handed the run's data: one of its arguments is a tensor, or a list, tuple, mapping or dataclass
  holding one (a batch, a draft tree, a state dict) -- or it is the command's entry;
- a kept call hangs under the nearest kept call it was made from (library frames in between, such as
  Lightning's loop, are skipped); a call into the same file as its parent is folded into the parent;
  each function appears once, where it is first reached, so the tree reads in the order the data
  first travels.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXCLUDED = {"tests", "scripts", ".venv", "docs", "conf"}
WALKS = ("training", "serving")
ENTRIES = {"training": ("train.py", "main"), "serving": ("cli/__init__.py", "main")}


def repository_file(path: str) -> str | None:
    """The repository-relative path of a code file, or None when the file is not traced."""
    try:
        rel = Path(path).resolve().relative_to(ROOT)
    except (ValueError, OSError):
        return None
    if (
        not rel.parts
        or rel.parts[0] in EXCLUDED
        or rel.parts[0].startswith(".")
        or rel.suffix != ".py"
    ):
        return None
    return rel.as_posix()


def carries_data(value: object, depth: int = 2) -> bool:
    """A tensor, or a container (list, tuple, mapping, dataclass) holding one within ``depth``
    levels."""
    import torch

    if isinstance(value, torch.Tensor):
        return True
    if depth == 0 or isinstance(value, (str, bytes, int, float, bool, type(None), Path)):
        return False
    if isinstance(value, dict):
        items = list(value.values())[:16]
    elif isinstance(value, (list, tuple)):
        items = list(value[:16])
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, f.name, None) for f in dataclasses.fields(value)][:16]
    else:
        return False
    return any(carries_data(item, depth - 1) for item in items)


def handed_data(frame) -> bool:
    """Whether a frame's arguments (``self`` aside) carry data."""
    code = frame.f_code
    count = (
        code.co_argcount
        + code.co_kwonlyargcount
        + bool(code.co_flags & 4)
        + bool(code.co_flags & 8)
    )
    names = [n for n in code.co_varnames[:count] if n not in ("self", "cls")]
    return any(carries_data(frame.f_locals.get(name)) for name in names)


class Tracer:
    """The profile hook: the tree of repository calls (``{"name", "file", "data", "children"}``),
    each function once (a later call of it hangs its new callees under its first node), calls into
    the caller's own file folded.
    """

    def __init__(self, entry: tuple[str, str]) -> None:
        self.entry, self.root = entry, {"name": "", "file": "", "data": False, "children": []}
        self.stack: list[
            tuple[object, dict]
        ] = []  # (frame, its node) of every traced call, folded ones included
        self.nodes: dict[tuple[str, str], dict] = {}
        self.files: dict[str, str | None] = {}

    def __call__(self, frame, event, arg) -> None:
        if event == "return":
            if self.stack and self.stack[-1][0] is frame:
                _, node = self.stack.pop()
                node["data"] = node["data"] or carries_data(
                    arg
                )  # what it hands back: a batch, a tree, weights
            return
        name = frame.f_code.co_filename
        rel = (
            self.files[name]
            if name in self.files
            else self.files.setdefault(name, repository_file(name))
        )
        # module bodies, lambdas
        if event != "call" or rel is None or frame.f_code.co_name.startswith("<"):
            return
        key = (rel, frame.f_code.co_qualname)
        parent = self.stack[-1][1] if self.stack else self.root
        if parent is self.root and key != self.entry:
            return  # before the entry (imports, argument parsing): not the data's path
        if parent["file"] == rel:
            node = parent  # folded into its caller in the same file
        elif key in self.nodes:
            node = self.nodes[key]
        else:
            node = self.nodes[key] = {"name": key[1], "file": rel, "data": False, "children": []}
            parent["children"].append(node)
        node["data"] = node["data"] or handed_data(frame)
        self.stack.append((frame, node))


def pruned(node: dict) -> dict | None:
    """``node`` without the subtrees that never touch data (None when nothing of it does)."""
    children = [kept for child in node["children"] if (kept := pruned(child)) is not None]
    if not children and not node["data"]:
        return None
    return {"name": node["name"], "file": node["file"], "children": children}


def argv_of(walk: str, work: Path) -> list[str]:
    """The command line of a walk: ``python train.py ARGV`` (training), ``draftsmith ARGV``
    (serving)."""
    if walk == "training":
        return [
            "recipe=eagle3",
            f"target.name_or_path={work / 'target'}",
            "target.dtype=fp32",
            f"data.spec={work / 'chat.jsonl'}",
            "data.limit=null",
            "data.max_length=48",
            "data.batch_size=4",
            "data.val_fraction=0.1",
            "trainer.max_steps=2",
            "run.checkpoint_every=2",
            "run.final_eval_batches=1",
            "drafter.target_layers=[1,2,3]",
            "drafter.draft_vocab_size=40",
            "drafter.ttt_steps=2",
            # the served-tau probe serves the export on purpose (the serving path covers that code)
            "validation.served_tau.every=0",
            f"hydra.run.dir={work / 'run'}",
        ]
    return [
        "bench",
        "--drafter",
        str(work / "run" / "export"),
        "--target",
        str(work / "target"),
        "--prompts",
        str(work / "prompts.jsonl"),
        "--num-prompts",
        "1",
        "--max-new-tokens",
        "4",
        "--skip-hf",
        "--lossless-dtype",
        "none",
        "--dtype",
        "fp32",
        # the export's own draft shape: the cost-aware default would pick one from measured timings,
        # which vary
        "--stop-policy",
        "export",
    ]


def run_one(walk: str, work: Path) -> dict:
    """Run one command in this interpreter under the tracer; its tree of kept calls."""
    # third-party imports before the profiler: they are not traced and run faster unprofiled
    import torch
    import transformers  # noqa: F401

    torch.set_num_threads(1)
    tracer, code = Tracer(ENTRIES[walk]), 0
    sys.setprofile(tracer)
    try:
        if walk == "training":  # as `python train.py ...` runs it
            import runpy

            sys.argv = [str(ROOT / "train.py"), *argv_of(walk, work)]
            runpy.run_path(sys.argv[0], run_name="__main__")
        else:
            import importlib

            code = importlib.import_module("draftsmith.cli").main(argv_of(walk, work))
    finally:
        sys.setprofile(None)
    if code not in (0, None):
        raise SystemExit(f"walk {walk} failed with status {code}")
    return pruned(tracer.root) or {"name": "", "file": "", "children": []}


def prepare(work: Path) -> None:
    """A tiny Llama target folder, a chat data file and a prompts file under ``work``
    (tests/conftest.py builders)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tiny_llama, build_tiny_tokenizer, make_conversations

    tokenizer = build_tiny_tokenizer()
    build_tiny_llama(len(tokenizer)).save_pretrained(work / "target")
    tokenizer.save_pretrained(work / "target")
    (work / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in make_conversations(64)))
    (work / "prompts.jsonl").write_text(
        json.dumps({"prompt": "hello world what is the answer ?"}) + "\n"
    )


def measure(work: Path) -> dict[str, dict]:
    """Both paths, each traced in a fresh interpreter (the training run writes the export the bench
    reads)."""
    for stale in (
        "run",
        "cache",
        "costs",
    ):  # a cached depth decision or an old run would change the path
        shutil.rmtree(work / stale, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stdout(
        sys.stderr
    ):  # library chatter on import must not mix into --json
        prepare(work)
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "DRAFTSMITH_CACHE": str(work / "cache"),
        "DRAFTSMITH_COST_CACHE": str(work / "costs"),
        "HYDRA_FULL_ERROR": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }  # the CPU path, whatever the machine has
    out = {}
    for walk in WALKS:
        proc = subprocess.run(
            [sys.executable, __file__, "--run-walk", walk, "--work", str(work)],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"walk {walk} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        command = ("python train.py " if walk == "training" else "draftsmith ") + " ".join(
            argv_of(walk, Path("WORK"))
        )
        out[walk] = {"command": command, "tree": json.loads(proc.stdout.strip().splitlines()[-1])}
    return out


def lines_of(node: dict, depth: int = 0) -> list[str]:
    """The tree as indented lines: ``file  function``, two spaces a level."""
    out = []
    for child in node["children"]:
        out.append(f"{'  ' * depth}{child['file']}  {child['name']}")
        out += lines_of(child, depth + 1)
    return out


def markdown(result: dict[str, dict]) -> str:
    """The data-path part of docs/ARCHITECTURE.md: per walk its command and its tree."""
    titles = {
        "training": "Training: `train.py recipe=eagle3` -> export",
        "serving": "Serving: `draftsmith bench`",
    }
    parts = []
    for walk, found in result.items():
        lines = lines_of(found["tree"])
        files = {line.split()[0] for line in lines}
        rooms = {f.split("/")[0] if "/" in f else f for f in files}
        parts.append(
            f"### {titles[walk]}: {len(lines)} functions in {len(files)} files, {len(rooms)}"
            f" rooms\n\n`{found['command']}`\n\n```\n" + "\n".join(lines) + "\n```\n"
        )
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Trace both paths; print them, or write them into docs/ARCHITECTURE.md."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the paths as JSON")
    parser.add_argument(
        "--write", action="store_true", help="rewrite the data-path part of docs/ARCHITECTURE.md"
    )
    parser.add_argument(
        "--keep", default=None, help="work folder to use and keep (default: a temporary one)"
    )
    parser.add_argument("--run-walk", choices=WALKS, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_walk:  # the child: one command, its tree as the last stdout line
        tree = run_one(args.run_walk, Path(args.work))
        print("\n" + json.dumps(tree))
        return 0
    if args.keep:
        result = measure(Path(args.keep))
    else:
        with tempfile.TemporaryDirectory(prefix="data-path-") as tmp:
            result = measure(Path(tmp))
    if args.write:
        sys.path.insert(0, str(Path(__file__).parent))
        import module_table

        module_table.DOC.write_text(
            module_table.replace_part(module_table.DOC.read_text(), "data-path", markdown(result))
        )
    print(json.dumps(result, indent=2) if args.json else markdown(result), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
