"""Run the fault sweep: every case of the table as a subprocess, classified (classify.py), into a
table.

    python tests/fault_sweep/run.py [--out DIR] [--only REGEX] [--list]        (`make fault-sweep`)

Each case gets a fresh scratch folder ``DIR/cases/<id>``; the world (world.py) is built once into
``DIR/world``. Writes ``DIR/results.json`` (one record per case) and ``DIR/results.md`` (clean % and
the count of each outcome class, by command and by owner, then every case that is not clean). Run it
alone at low priority: it starts a Python process per case (about 200 of them).
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
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from case import Case  # noqa: E402
from cases import CASES  # noqa: E402
from classify import Seen, classify  # noqa: E402
from report import write_docs, write_report  # noqa: E402
from setups import Mounts, apply_setup  # noqa: E402
from world import load_or_build  # noqa: E402

TINY = (
    "target.dtype=fp32 data.limit=null data.max_length=48 data.batch_size=4 data.val_fraction=0.1"
    " trainer.max_steps=2 trainer.log_every_n_steps=1 run.checkpoint_every=1"
    " run.final_eval_batches=1 optim.warmup_steps=0 validation.served_tau.every=0"
)
CLEAN_ENV = ("DRAFTSMITH_TRACEBACK", "DRAFTSMITH_DEBUG", "HYDRA_FULL_ERROR")


def expand(text: str, places: dict[str, str]) -> str:
    """``text`` with every ``{NAME}`` placeholder replaced (unknown names are left as they are)."""
    return re.sub(r"\{(\w+)\}", lambda m: places.get(m.group(1), m.group(0)), text)


def tiny_preset(cmd: str, preset: str) -> str:
    """``preset`` (the tiny-run keys) without the keys ``cmd`` sets itself: train.py refuses a key
    given twice, and a case's own value is the one it means (``TRAIN + " trainer.max_steps=3"``
    resumes a 2-step run to step 3).
    """
    own = {w.split("=", 1)[0].lstrip("+") for w in cmd.replace("{TINY}", "").split() if "=" in w}
    return " ".join(w for w in preset.split() if w.split("=", 1)[0] not in own)


def argv_of(cmd: str, places: dict[str, str]) -> list[str]:
    """The process argv of a case command (``ds ...``: the CLI, ``train ...``: train.py in the run's
    scratch)."""
    words = shlex.split(expand(cmd, {**places, "TINY": tiny_preset(cmd, places.get("TINY", TINY))}))
    head, rest = words[0], words[1:]
    if head == "train" and not any(w.startswith("hydra.run.dir=") for w in rest):
        rest.append(f"hydra.run.dir={places['S']}/run")
    return {
        "ds": [sys.executable, "-m", "draftsmith.cli"],
        "train": [sys.executable, str(ROOT / "train.py")],
        "py": [sys.executable],
    }[head] + rest


def digest(path: Path) -> dict[str, str]:
    """path -> sha256 of every file under ``path`` (itself if a file); empty when it does not
    exist."""
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.rglob("*") if p.is_file())
        if path.is_dir()
        else []
    )
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def changed_inputs(
    before: dict[str, tuple[str, dict[str, str], bytes]], places: dict[str, str]
) -> list[str]:
    """The protected inputs whose bytes changed (``append``: whose old bytes are no longer a
    prefix)."""
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


def _drain(stream, chunks: list[bytes]) -> None:
    for chunk in iter(lambda: os.read(stream.fileno(), 4096), b""):
        chunks.append(chunk)


def run_process(
    argv: list[str], case: Case, env: dict[str, str], cwd: Path
) -> tuple[int | None, str, str]:
    """(exit status or None on a hang, stdout, stderr); sends Ctrl-C (SIGINT to the process group)
    once ``case.sigint_on`` appears on stdout or stderr, ``case.sigint_after`` seconds later (or
    after that many seconds from the start when there is no pattern)."""
    # SIGINT back to its default: a sweep started in the background (`make fault-sweep &`) inherits
    # it ignored, and Python then never raises KeyboardInterrupt, so a Ctrl-C case would test
    # nothing.
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    out, err = [], []
    readers = [
        threading.Thread(target=_drain, args=(s, b), daemon=True)
        for s, b in ((proc.stdout, out), (proc.stderr, err))
    ]
    for reader in readers:
        reader.start()
    if case.stdin:
        proc.stdin.write(case.stdin.encode())
    proc.stdin.close()
    deadline = time.monotonic() + case.timeout
    if case.sigint_after is not None or case.sigint_on:
        pattern = re.compile(case.sigint_on) if case.sigint_on else None
        while (
            proc.poll() is None
            and time.monotonic() < deadline
            and pattern is not None
            and not pattern.search(b"".join(out + err).decode(errors="replace"))
        ):
            time.sleep(0.05)
        time.sleep(case.sigint_after or 0.0)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
    try:
        code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    for reader in readers:
        reader.join(timeout=10)
    return code, b"".join(out).decode(errors="replace"), b"".join(err).decode(errors="replace")


def sweep_cache(out: Path) -> Path:
    """A draftsmith cache for the cases: the user's cache entries linked in (the embedded target,
    the assets), so nothing is converted again, but caches the cases write (tokenised data, measured
    costs) stay in the sweep.
    """
    from draftsmith.assets import cache_dir

    cache = out / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    real = cache_dir()
    for entry in sorted(real.iterdir()) if real.is_dir() else []:
        link = cache / entry.name
        if entry.name not in ("data", "flagship", "costs", "curves") and not link.exists():
            link.symlink_to(entry)
    return cache


def run_case(case: Case, places: dict[str, str], scratch: Path) -> dict:
    """Set up, run, rerun and classify one case; returns its record."""
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    places = {**places, "S": str(scratch), "TINY": TINY}
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    env.update(
        SWEEP_MARKER=places["MARK"],
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_MODE="offline",
        DRAFTSMITH_COST_CACHE=str(scratch / ".costs"),
        DRAFTSMITH_CACHE=places["CACHE"],
        PYTHONPATH=env.get("PYTHONPATH", ""),
        **case.env,
    )
    Path(places["MARK"]).unlink(missing_ok=True)
    start = time.perf_counter()
    with Mounts() as mounts:
        skipped = apply_setup(case.setup, places, mounts, env, ROOT)
        if skipped:
            return {
                "id": case.id,
                "owner": case.owner,
                "cmd": case.cmd,
                "outcome": "skipped",
                "reason": skipped,
            }
        before = snapshot(case, places)
        code, out, err = run_process(argv_of(case.cmd, places), case, env, ROOT)
        seen = Seen(code, err, out, code_ran=Path(places["MARK"]).exists())
        if case.rerun and code is not None:
            rerun = Case(case.id + ":rerun", case.rerun, timeout=case.timeout)
            seen.rerun_returncode, _, seen.rerun_stderr = run_process(
                argv_of(case.rerun, places), rerun, env, ROOT
            )
        seen.changed = changed_inputs(before, places)
    outcome, reason = classify(
        seen, case.expect, case.mentions, traceback_ok="--traceback" in case.cmd
    )
    return {
        "id": case.id,
        "owner": case.owner,
        "cmd": case.cmd,
        "expect": case.expect,
        "outcome": outcome,
        "reason": reason,
        "returncode": code,
        "seconds": round(time.perf_counter() - start, 1),
        "stderr_tail": err[-1500:],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fault-sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", default=str(ROOT / "outputs" / "fault_sweep"), help="results and scratch folder"
    )
    parser.add_argument("--only", default=None, help="run the cases whose id matches this regex")
    parser.add_argument("--list", action="store_true", help="print the case ids and stop")
    parser.add_argument(
        "--docs", action="store_true", help="write the last results into docs/ERRORS.md and stop"
    )
    opts = parser.parse_args(argv)
    cases = [c for c in CASES if not opts.only or re.search(opts.only, c.id)]
    if opts.list:
        print("\n".join(f"{c.id}  [{c.owner}]  {c.cmd}" for c in cases))
        return 0
    out = Path(opts.out)
    if opts.docs:
        places = json.loads((out / "world" / "world.json").read_text())
        write_docs(
            json.loads((out / "results.json").read_text()),
            places,
            str(out / "cases"),
            ROOT / "docs" / "ERRORS.md",
        )
        return 0
    places = {**load_or_build(out / "world"), "CACHE": str(sweep_cache(out))}
    # a partial run (--only) updates its cases and keeps the others' last results
    saved = out / "results.json"
    known = {c.id for c in CASES}
    results = {
        r["id"]: r
        for r in (json.loads(saved.read_text()) if saved.is_file() else [])
        if r["id"] in known
    }
    for n, case in enumerate(cases, 1):
        record = run_case(case, places, out / "cases" / case.id)
        results[case.id] = record
        print(
            f"[{n}/{len(cases)}] {record['outcome']:<10} {case.id}:"
            f" {record.get('reason', '')[:150]}",
            flush=True,
        )
        saved.write_text(json.dumps([results[c.id] for c in CASES if c.id in results], indent=1))
    print(write_report([results[c.id] for c in CASES if c.id in results], out / "results.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
