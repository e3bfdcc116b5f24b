"""Run the fault sweep: every case of the table as a subprocess, classified (classify.py), into a table.

    python tests/fault_sweep/run.py [--out DIR] [--only REGEX] [--list]        (`make fault-sweep`)

Each case gets a fresh scratch folder ``DIR/cases/<id>``; the world (world.py) is built once into ``DIR/world``.
Writes ``DIR/results.json`` (one record per case) and ``DIR/results.md`` (clean % and the count of each outcome
class, by command and by owner, then every case that is not clean). Run it alone at low priority: it starts a
Python process per case (about 200 of them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from case import Case  # noqa: E402
from cases import CASES  # noqa: E402
from classify import Seen, classify  # noqa: E402
from report import write_report  # noqa: E402
from setups import Mounts, apply_setup  # noqa: E402
from world import load_or_build  # noqa: E402

TINY = ("target.dtype=fp32 data.limit=null data.max_length=48 data.batch_size=4 data.val_fraction=0.1 "
        "trainer.max_steps=2 trainer.log_every_n_steps=1 run.checkpoint_every=1 run.final_eval_batches=1 "
        "optim.warmup_steps=0 validation.served_tau.every=0")
CLEAN_ENV = ("DRAFTSMITH_TRACEBACK", "DRAFTSMITH_DEBUG", "HYDRA_FULL_ERROR")


def expand(text: str, places: dict[str, str]) -> str:
    """``text`` with every ``{NAME}`` placeholder replaced (unknown names are left as they are)."""
    return re.sub(r"\{(\w+)\}", lambda m: places.get(m.group(1), m.group(0)), text)


def argv_of(cmd: str, places: dict[str, str]) -> list[str]:
    """The process argv of a case command (``ds ...``: the CLI, ``train ...``: train.py in the run's scratch)."""
    words = shlex.split(expand(cmd, places))
    head, rest = words[0], words[1:]
    if head == "train" and not any(w.startswith("hydra.run.dir=") for w in rest):
        rest.append(f"hydra.run.dir={places['S']}/run")
    return {"ds": [sys.executable, "-m", "draftsmith.cli"], "train": [sys.executable, str(ROOT / "train.py")],
            "py": [sys.executable]}[head] + rest


def digest(path: Path) -> dict[str, str]:
    """path -> sha256 of every file under ``path`` (itself if a file); empty when it does not exist."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def changed_inputs(before: dict[str, tuple[str, dict[str, str], bytes]], places: dict[str, str]) -> list[str]:
    """The protected inputs whose bytes changed (``append``: whose old bytes are no longer a prefix)."""
    changed = []
    for spec, (mode, hashes, prefix) in before.items():
        path = Path(expand(spec.removeprefix("append:"), places))
        if mode == "append":
            now = path.read_bytes() if path.is_file() else b""
            if not now.startswith(prefix):
                changed.append(str(path))
        elif digest(path) != hashes:
            changed.append(str(path))
    return changed


def snapshot(case: Case, places: dict[str, str]) -> dict[str, tuple[str, dict[str, str], bytes]]:
    out = {}
    for spec in case.protect:
        path = Path(expand(spec.removeprefix("append:"), places))
        if spec.startswith("append:"):
            out[spec] = ("append", {}, path.read_bytes() if path.is_file() else b"")
        else:
            out[spec] = ("exact", digest(path), b"")
    return out


def run_process(argv: list[str], case: Case, env: dict[str, str], cwd: Path) -> tuple[int | None, str, str]:
    """(exit status or None on a hang, stdout, stderr); sends SIGINT when the case asks for it."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if case.sigint_after is not None:
            time.sleep(case.sigint_after)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(case.stdin, timeout=case.timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def run_case(case: Case, places: dict[str, str], scratch: Path) -> dict:
    """Set up, run, rerun and classify one case; returns its record."""
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    places = {**places, "S": str(scratch), "TINY": TINY}
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    env.update(SWEEP_MARKER=places["MARK"], HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline",
               DRAFTSMITH_COST_CACHE=str(scratch / ".costs"), PYTHONPATH=env.get("PYTHONPATH", ""), **case.env)
    Path(places["MARK"]).unlink(missing_ok=True)
    start = time.perf_counter()
    with Mounts() as mounts:
        skipped = apply_setup(case.setup, places, mounts, env, ROOT)
        if skipped:
            return {"id": case.id, "owner": case.owner, "cmd": case.cmd, "outcome": "skipped", "reason": skipped}
        before = snapshot(case, places)
        code, out, err = run_process(argv_of(case.cmd, places), case, env, ROOT)
        seen = Seen(code, err, out, code_ran=Path(places["MARK"]).exists())
        if case.rerun and code is not None:
            rerun = Case(case.id + ":rerun", case.rerun, timeout=case.timeout)
            seen.rerun_returncode, _, seen.rerun_stderr = run_process(argv_of(case.rerun, places), rerun, env, ROOT)
        seen.changed = changed_inputs(before, places)
    outcome, reason = classify(seen, case.expect, case.mentions, traceback_ok="--traceback" in case.cmd)
    return {"id": case.id, "owner": case.owner, "cmd": case.cmd, "expect": case.expect, "outcome": outcome,
            "reason": reason, "returncode": code, "seconds": round(time.perf_counter() - start, 1),
            "stderr_tail": err[-1500:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fault-sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "outputs" / "fault_sweep"), help="results and scratch folder")
    parser.add_argument("--only", default=None, help="run the cases whose id matches this regex")
    parser.add_argument("--list", action="store_true", help="print the case ids and stop")
    opts = parser.parse_args(argv)
    cases = [c for c in CASES if not opts.only or re.search(opts.only, c.id)]
    if opts.list:
        print("\n".join(f"{c.id}  [{c.owner}]  {c.cmd}" for c in cases))
        return 0
    out = Path(opts.out)
    places = load_or_build(out / "world")
    results = []
    for n, case in enumerate(cases, 1):
        record = run_case(case, places, out / "cases" / case.id)
        results.append(record)
        print(f"[{n}/{len(cases)}] {record['outcome']:<10} {case.id}: {record.get('reason', '')[:150]}", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    print(write_report(results, out / "results.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
