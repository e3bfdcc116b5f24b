"""Measure the two walks of docs/ARCHITECTURE.md: which repository files a command enters, in order, and how often
it crosses from one room to another.

    .venv/bin/python scripts/room_walk.py [--json] [--keep DIR]

Definition (what tests/test_room_walk.py keeps true):
- each walk runs in a fresh interpreter under ``sys.setprofile`` (main thread); every ``call`` event whose code file
  lies in the repository (not ``tests/``, ``scripts/``, ``.venv/``) is recorded -- module bodies run by an import
  are calls too, so importing a file enters it;
- the walk is the list of those files in the order they are FIRST entered, each with its room: the top folder
  (``runtime/target/model.py`` is room ``runtime``), or the file itself for a top-level file (``train.py``,
  ``assets.py``, the package's ``__init__.py``);
- boundaries = consecutive pairs of that list whose rooms differ; re-entries = boundaries into a room the walk had
  already left.
Walks, on a tiny in-process Llama target (tests/conftest.py builds it):
- training: ``python train.py recipe=eagle3 ...`` (the Hydra entry) for 2 steps; it writes ``<run>/export``;
- serving: ``draftsmith bench --drafter <run>/export --num-prompts 1 --max-new-tokens 4 --skip-hf``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXCLUDED = {"tests", "scripts", ".venv", "docs", "conf"}
WALKS = ("training", "serving")


def room_of(path: str) -> tuple[str, str] | None:
    """(room, repository-relative file) of a code file, or None when the file is not walked."""
    try:
        rel = Path(path).resolve().relative_to(ROOT)
    except (ValueError, OSError):
        return None
    if not rel.parts or rel.parts[0] in EXCLUDED or rel.parts[0].startswith(".") or rel.suffix != ".py":
        return None
    return (rel.parts[0] if len(rel.parts) > 1 else rel.name), rel.as_posix()


def count(walk: list[tuple[str, str]]) -> dict:
    """Boundaries crossed and re-entries of a first-entry walk, plus the rooms re-entered most."""
    boundaries, reentries, seen, by_room = 0, 0, set(), {}
    for i, (room, _) in enumerate(walk):
        if i and room != walk[i - 1][0]:
            boundaries += 1
            if room in seen:
                reentries += 1
                by_room[room] = by_room.get(room, 0) + 1
        seen.add(room)
    return {"files": len(walk), "rooms": len(seen), "boundaries": boundaries, "reentries": reentries,
            "reentered": dict(sorted(by_room.items(), key=lambda kv: -kv[1]))}


def argv_of(walk: str, work: Path) -> list[str]:
    """The command line of a walk: ``python train.py ARGV`` (training), ``draftsmith ARGV`` (serving)."""
    if walk == "training":
        return ["recipe=eagle3", f"target.name_or_path={work / 'target'}", "target.dtype=fp32",
                f"data.spec={work / 'chat.jsonl'}", "data.limit=null", "data.max_length=48", "data.batch_size=4",
                "data.val_fraction=0.1", "trainer.max_steps=2", "run.checkpoint_every=2", "run.final_eval_batches=1",
                "drafter.target_layers=[1,2,3]", "drafter.draft_vocab_size=40", "drafter.ttt_steps=2",
                # the served-tau probe serves the export on purpose (the serving walk covers that code)
                "validation.served_tau.every=0", f"hydra.run.dir={work / 'run'}"]
    return ["bench", "--drafter", str(work / "run" / "export"), "--target", str(work / "target"),
            "--prompts", str(work / "prompts.jsonl"), "--num-prompts", "1", "--max-new-tokens", "4", "--skip-hf",
            "--lossless-dtype", "none", "--dtype", "fp32"]


def run_one(walk: str, work: Path) -> dict[str, list[tuple[str, str]]]:
    """Run one walk in this interpreter under the profiler: its first-entry (room, file) list, and the same list
    counting function calls only (module bodies run by imports left out; informative, not what the test bounds)."""
    import torch  # third-party imports before the profiler: they are not walked and run faster unprofiled
    import transformers  # noqa: F401

    torch.set_num_threads(1)
    first: dict[str, str] = {}  # every call, module bodies included
    called: dict[str, str] = {}  # function calls only (what is left when imports are not counted)
    known: dict[str, tuple[str, str] | None] = {}

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            hit = known.get(name, 0)
            if hit == 0:
                hit = known[name] = room_of(name)
            if hit is not None:
                first.setdefault(hit[1], hit[0])
                if frame.f_code.co_name != "<module>":
                    called.setdefault(hit[1], hit[0])

    code = 0
    sys.setprofile(profile)
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
    return {"walk": [(room, path) for path, room in first.items()],
            "calls_only": [(room, path) for path, room in called.items()]}


def prepare(work: Path) -> None:
    """A tiny Llama target folder, a chat data file and a prompts file under ``work`` (tests/conftest.py builders)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tiny_llama, build_tiny_tokenizer, make_conversations

    tokenizer = build_tiny_tokenizer()
    build_tiny_llama(len(tokenizer)).save_pretrained(work / "target")
    tokenizer.save_pretrained(work / "target")
    (work / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in make_conversations(64)))
    (work / "prompts.jsonl").write_text(json.dumps({"prompt": "hello world what is the answer ?"}) + "\n")


def measure(work: Path) -> dict[str, dict]:
    """Both walks, each in a fresh interpreter (so that imports are walked the same way every time)."""
    for stale in ("run", "cache", "costs"):  # a cached depth decision or an old run would change the walk
        shutil.rmtree(work / stale, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stdout(sys.stderr):  # library chatter on import must not mix into --json
        prepare(work)
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "DRAFTSMITH_CACHE": str(work / "cache"), "DRAFTSMITH_COST_CACHE": str(work / "costs"),
           "HYDRA_FULL_ERROR": "1"}
    out = {}
    for walk in WALKS:
        proc = subprocess.run([sys.executable, __file__, "--run-walk", walk, "--work", str(work)], cwd=work, env=env,
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"walk {walk} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        child = json.loads(proc.stdout.strip().splitlines()[-1])
        files, calls = ([tuple(x) for x in child[k]] for k in ("walk", "calls_only"))
        command = ("python train.py " if walk == "training" else "draftsmith ") + " ".join(argv_of(walk, Path("WORK")))
        out[walk] = {"command": command, "walk": files, **count(files), "calls_only": {"walk": calls, **count(calls)}}
    return out


def table(name: str, result: dict) -> str:
    lines = [f"## {name} walk: {result['files']} files, {result['rooms']} rooms, {result['boundaries']} room "
             f"boundaries crossed, {result['reentries']} re-entries", "", "| # | room | file |", "|---|---|---|"]
    lines += [f"| {i} | {room} | `{path}` |" for i, (room, path) in enumerate(result["walk"], 1)]
    if result["reentered"]:
        lines += ["", "re-entered: " + ", ".join(f"{r} x{n}" for r, n in result["reentered"].items())]
    calls = result["calls_only"]
    runs = [room for i, (room, _) in enumerate(calls["walk"]) if not i or room != calls["walk"][i - 1][0]]
    lines += ["", f"function calls only (imports not counted): {calls['files']} files, {calls['boundaries']} "
              f"boundaries, {calls['reentries']} re-entries: " + " -> ".join(runs)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the walks as JSON")
    parser.add_argument("--keep", default=None, help="work folder to use and keep (default: a temporary one)")
    parser.add_argument("--run-walk", choices=WALKS, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_walk:  # the child: one walk, its list as the last stdout line
        walk = run_one(args.run_walk, Path(args.work))
        print("\n" + json.dumps(walk))
        return 0
    if args.keep:
        result = measure(Path(args.keep))
    else:
        with tempfile.TemporaryDirectory(prefix="room-walk-") as tmp:
            result = measure(Path(tmp))
    print(json.dumps(result, indent=2) if args.json else "\n\n".join(table(n, r) for n, r in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
