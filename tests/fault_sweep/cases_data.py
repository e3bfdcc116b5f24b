"""Fault cases of the commands that write training data: regenerate, rollouts, trajectories and
diffusion-export (the commands that write or read exports: cases_exports.py)."""

from __future__ import annotations

from case import c, copy, file, ok

REGEN = "ds regenerate --target {T} --limit 2 --max-new-tokens 3 --dtype fp32 --batch-size 2"
ROLL = "ds rollouts --target {T} --limit 1 --samples-per-prompt 2 --max-new-tokens 2 --no-progress"
TRAJ = "ds trajectories --limit 1 --gen-length 32"
REGEN_SETTINGS = (  # what REGEN records
    '{"data": "{DATA}", "target": "{T}", "max_new_tokens": 3, "temperature": 0.0, "top_p": 1.0, '
    '"turns": "first", "dtype": "fp32", "seed": 0, "batch_size": 2}'
)

REGENERATE = [
    ok("regen-ok", REGEN + " --data {DATA} --out {S}/out.jsonl"),
    c(
        "regen-out-is-data",
        REGEN + " --data {S}/d.jsonl --out {S}/d.jsonl",
        "--out",
        setup=(copy("{DATA}", "{S}/d.jsonl"),),
        protect=("{S}/d.jsonl",),
    ),
    c(
        "regen-out-users-file",
        REGEN + " --data {DATA} --out {S}/mine.jsonl",
        "mine.jsonl",
        setup=(file("{S}/mine.jsonl", '{"mine": true}\n'),),
        protect=("{S}/mine.jsonl",),
    ),
    c(
        "regen-out-dir",
        REGEN + " --data {DATA} --out {S}/dir",
        "dir",
        setup=(file("{S}/dir/keep.txt"),),
        protect=("{S}/dir",),
        rerun="py -c \"import pathlib,sys; sys.exit(pathlib.Path('{S}/dir.partial').exists())\"",
    ),
    c(
        "regen-out-parent-file",
        REGEN + " --data {DATA} --out {S}/f/out.jsonl",
        "--out",
        setup=(file("{S}/f"),),
        protect=("{S}/f",),
    ),
    c(
        "regen-out-read-only",
        REGEN + " --data {DATA} --out {S}/ro/out.jsonl",
        "--out",
        setup=(("ro", "{S}/ro"),),
    ),
    c(
        "regen-out-full-disk",
        REGEN.replace("--limit 2", "--limit 8") + " --data {DATA} --out {S}/full/out.jsonl",
        "space",
        setup=(("full", "{S}/full", 4),),
    ),
    c("regen-data-missing", REGEN + " --data {S}/nosuch.jsonl --out {S}/o.jsonl", "nosuch"),
    c("regen-data-binary", REGEN + " --data {BIN} --out {S}/o.jsonl", "UTF-8"),
    c("regen-data-dir", REGEN + " --data {EMPTY} --out {S}/o.jsonl", "empty"),
    c(
        "regen-data-empty-file",
        REGEN + " --data {S}/d.jsonl --out {S}/o.jsonl",
        "no conversations",
        setup=(file("{S}/d.jsonl", ""),),
    ),
    c(
        "regen-data-bad-json",
        REGEN + " --data {S}/d.jsonl --out {S}/o.jsonl",
        "d.jsonl",
        setup=(file("{S}/d.jsonl", '{"conversations": [\n'),),
    ),
    c(
        "regen-data-no-conversations",
        REGEN + " --data {S}/d.jsonl --out {S}/o.jsonl",
        "conversations",
        setup=(file("{S}/d.jsonl", '{"text": "hi"}\n'),),
    ),
    c(
        "regen-data-bad-role",
        REGEN + " --data {S}/d.jsonl --out {S}/o.jsonl",
        "role",
        setup=(file("{S}/d.jsonl", '{"messages": [{"role": "wizard", "content": "hi"}]}\n'),),
    ),
    c(
        "regen-target-missing",
        REGEN.replace("{T}", "{S}/nosuch") + " --data {DATA} --out {S}/o.jsonl",
        "nosuch",
    ),
    c(
        "regen-target-remote",
        REGEN.replace("{T}", "{REMOTE}") + " --data {DATA} --out {S}/o.jsonl",
        "--trust-remote-code",
    ),
    c(
        "regen-target-export",
        REGEN.replace("{T}", "{MED}") + " --data {DATA} --out {S}/o.jsonl",
        "export",
    ),
    c(
        "regen-limit-zero",
        REGEN.replace("--limit 2", "--limit 0") + " --data {DATA} --out {S}/o.jsonl",
        "--limit",
    ),
    c("regen-top-p-zero", REGEN + " --data {DATA} --out {S}/o.jsonl --top-p 0", "--top-p"),
    c("regen-skip-negative", REGEN + " --data {DATA} --out {S}/o.jsonl --skip -1", "--skip"),
    c("regen-skip-past-end", REGEN + " --data {DATA} --out {S}/o.jsonl --skip 100000", "100000"),
    c(
        "regen-max-prompt-tokens-zero",
        REGEN + " --data {DATA} --out {S}/o.jsonl --max-prompt-tokens 0",
        "--max-prompt-tokens",
    ),
    c(
        "regen-partial-other-settings",
        REGEN + " --data {DATA} --out {S}/o.jsonl --seed 5",
        "settings",
        setup=(file("{S}/o.jsonl.partial", ""), file("{S}/o.jsonl.partial.json", '{"seed": 1}')),
    ),
    c(
        "regen-partial-no-settings",
        REGEN + " --data {DATA} --out {S}/o.jsonl",
        "settings file",
        setup=(file("{S}/o.jsonl.partial", '{"source_index": 0}\n'),),
    ),
    c(
        "regen-partial-corrupt",
        REGEN + " --data {DATA} --out {S}/o.jsonl",
        "corrupt",
        setup=(
            file("{S}/o.jsonl.partial", '{"source_index": 0}\nGARBAGE\n{"source_index": 1}\n'),
            file("{S}/o.jsonl.partial.json", REGEN_SETTINGS),
        ),
    ),
    c(
        "regen-sigint",
        REGEN.replace("--limit 2", "--limit 16").replace(
            "--max-new-tokens 3", "--max-new-tokens 60"
        )
        + " --data {DATA} --out {S}/o.jsonl --batch-size 1",
        "interrupted",
        expect="interrupt",
        sigint_on=r"\[1/16\] wrote",
        rerun=REGEN.replace("--limit 2", "--limit 16").replace(
            "--max-new-tokens 3", "--max-new-tokens 60"
        )
        + " --data {DATA} --out {S}/o.jsonl --batch-size 1",
    ),
]

ROLLOUTS = [
    ok("rollouts-ok", ROLL + " --out {S}/r"),
    c(
        "rollouts-out-file",
        ROLL + " --out {S}/f",
        "file",
        setup=(file("{S}/f"),),
        protect=("{S}/f",),
    ),
    c(
        "rollouts-out-users-folder",
        ROLL + " --out {S}/mine",
        "mine",
        setup=(file("{S}/mine/notes.txt"),),
        protect=("{S}/mine",),
    ),
    c("rollouts-out-read-only", ROLL + " --out {S}/ro/r", "--out", setup=(("ro", "{S}/ro"),)),
    c("rollouts-limit-zero", ROLL.replace("--limit 1", "--limit 0") + " --out {S}/r", "--limit"),
    c(
        "rollouts-max-new-tokens-zero",
        ROLL.replace("--max-new-tokens 2", "--max-new-tokens 0") + " --out {S}/r",
        "--max-new-tokens",
    ),
    c("rollouts-dtype-fp16", ROLL + " --dtype fp16 --out {S}/r", "fp16"),
    c(
        "rollouts-samples-one",
        ROLL.replace("--samples-per-prompt 2", "--samples-per-prompt 1") + " --out {S}/r",
        "--samples-per-prompt",
    ),
    c("rollouts-grid-negative", ROLL + " --grid 0,-1 --out {S}/r", "--grid"),
    c("rollouts-granularity-bad", ROLL + " --granularity word --out {S}/r", "granularity"),
    c("rollouts-reward-unknown", ROLL + " --reward nosuch.mod:fn --out {S}/r", "nosuch"),
    c(
        "rollouts-target-remote",
        ROLL.replace("{T}", "{REMOTE}") + " --out {S}/r",
        "--trust-remote-code",
    ),
    c("rollouts-target-missing", ROLL.replace("{T}", "{S}/nosuch") + " --out {S}/r", "nosuch"),
    c("rollouts-prompts-missing", ROLL + " --prompts {S}/nosuch.jsonl --out {S}/r", "nosuch"),
    c("rollouts-controller-medusa", ROLL + " --controller {MED} --out {S}/r", "medusa"),
    c("rollouts-threads-zero", ROLL + " --threads 0 --out {S}/r", "--threads"),
    c("rollouts-seed-negative", ROLL + " --seed -1 --out {S}/r", "--seed"),
]

TRAJECTORIES = [
    c("traj-target-not-diffusion", TRAJ + " --target {T} --out {S}/t", "diffusion"),
    c("traj-target-missing", TRAJ + " --target {S}/nosuch --out {S}/t", "nosuch"),
    c("traj-target-remote", TRAJ + " --target {REMOTE} --out {S}/t", "--trust-remote-code"),
    c(
        "traj-out-file",
        TRAJ + " --target {T} --out {S}/f",
        "file",
        setup=(file("{S}/f"),),
        protect=("{S}/f",),
    ),
    c(
        "traj-out-users-folder",
        TRAJ + " --target {T} --out {S}/mine",
        "mine",
        setup=(file("{S}/mine/notes.txt"),),
        protect=("{S}/mine",),
    ),
    c(
        "traj-prompts-missing",
        TRAJ + " --target {T} --prompts {S}/nosuch.txt --out {S}/t",
        "nosuch",
    ),
    c(
        "traj-limit-zero",
        TRAJ.replace("--limit 1", "--limit 0") + " --target {T} --out {S}/t",
        "--limit",
    ),
    c("diffusion-export-medusa", "ds diffusion-export {MED} --out {S}/d", "diffusion"),
    c("diffusion-export-missing", "ds diffusion-export {S}/nosuch --out {S}/d", "nosuch"),
    c(
        "diffusion-export-out-is-source",
        "ds diffusion-export {S}/m --out {S}/m",
        "--out",
        setup=(copy("{MED}", "{S}/m"),),
        protect=("{S}/m",),
    ),
]


CASES = [*REGENERATE, *ROLLOUTS, *TRAJECTORIES]
