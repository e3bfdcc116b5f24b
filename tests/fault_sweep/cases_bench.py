"""Fault cases of the commands that measure an export: bench (every mode), calibrate and
engine-check."""

from __future__ import annotations

from case import c, copy, file, ok

BENCH = (
    "ds bench export --prompts {PROMPTS} --num-prompts 1 --max-new-tokens 4 --dtype fp32 --skip-hf "
    "--lossless-dtype none --target {T}"
)

BENCH_CASES = [
    ok("bench-ok-medusa", BENCH + " --drafter {MED} --out {S}/b"),
    c(
        "bench-out-file",
        BENCH + " --drafter {MED} --out {S}/f",
        "file",
        setup=(file("{S}/f"),),
        protect=("{S}/f",),
    ),
    c(
        "bench-out-users-folder",
        BENCH + " --drafter {MED} --out {S}/mine",
        "mine",
        setup=(file("{S}/mine/notes.txt"), file("{S}/mine/bench.json", '{"mine": 1}')),
        protect=("{S}/mine",),
    ),
    c(
        "bench-out-is-drafter",
        BENCH + " --drafter {S}/m --out {S}/m",
        "--out",
        setup=(copy("{MED}", "{S}/m"),),
        protect=("{S}/m",),
    ),
    c(
        "bench-out-inside-target",
        BENCH.replace("{T}", "{S}/t") + " --drafter {MED} --out {S}/t/bench",
        "--out",
        setup=(copy("{T}", "{S}/t"),),
        protect=("{S}/t",),
    ),
    c(
        "bench-out-read-only",
        BENCH + " --drafter {MED} --out {S}/ro/b",
        "--out",
        setup=(("ro", "{S}/ro"),),
    ),
    c(
        "bench-out-parent-is-file",
        BENCH + " --drafter {MED} --out {S}/f/b",
        "--out",
        setup=(file("{S}/f"),),
        protect=("{S}/f",),
    ),
    c("bench-prompts-missing", BENCH + " --drafter {MED} --prompts {S}/nosuch.jsonl", "nosuch"),
    c("bench-prompts-dir", BENCH + " --drafter {MED} --prompts {EMPTY}", "folder"),
    c("bench-prompts-binary", BENCH + " --drafter {MED} --prompts {BIN}", "UTF-8"),
    c(
        "bench-prompts-empty-file",
        BENCH + " --drafter {MED} --prompts {S}/p.jsonl",
        "no prompts",
        setup=(file("{S}/p.jsonl", ""),),
    ),
    c(
        "bench-prompts-list-line",
        BENCH + " --drafter {MED} --prompts {S}/p.jsonl",
        "object",
        setup=(file("{S}/p.jsonl", '["a", "b"]\n'),),
    ),
    c(
        "bench-prompts-bad-json",
        BENCH + " --drafter {MED} --prompts {S}/p.jsonl",
        "JSON",
        setup=(file("{S}/p.jsonl", '{"prompt": \n'),),
    ),
    c(
        "bench-prompts-no-prompt-key",
        BENCH + " --drafter {MED} --prompts {S}/p.jsonl",
        "prompt",
        setup=(file("{S}/p.jsonl", '{"text": "hi"}\n'),),
    ),
    c(
        "bench-prompts-slice-reversed",
        BENCH + " --drafter {MED} --prompts 'mtbench[5:2]'",
        "mtbench[5:2]",
    ),
    c(
        "bench-prompts-slice-letters",
        BENCH + " --drafter {MED} --prompts 'mtbench[a:b]'",
        "mtbench[a:b]",
    ),
    c(
        "bench-prompts-slice-unknown-set",
        BENCH + " --drafter {MED} --prompts 'nosuch[0:3]'",
        "nosuch",
    ),
    c(
        "bench-prompts-slice-past-end",
        BENCH + " --drafter {MED} --prompts 'mtbench[500:]'",
        "mtbench[500:]",
    ),
    c(
        "bench-prompts-too-long",
        BENCH + " --drafter {MED} --prompts {S}/p.jsonl",
        "context",
        setup=(file("{S}/p.jsonl", '{"prompt": "' + "hello " * 600 + '"}\n'),),
    ),
    c("bench-num-prompts-zero", BENCH + " --drafter {MED} --num-prompts 0", "--num-prompts"),
    c("bench-no-drafter", BENCH, "--drafter"),
    c("bench-engine-parity-no-drafter", BENCH + " --engine-parity", "--drafter"),
    c(
        "bench-drafter-nan",
        BENCH + " --drafter {S}/m",
        "NaN",
        setup=(copy("{MED}", "{S}/m"), ("nan", "{S}/m/model.safetensors")),
    ),
    c("bench-drafter-speculators", BENCH + " --drafter {SPEC}", "speculators"),
    c("bench-drafter-is-target", BENCH + " --drafter {T}", "target model folder"),
    c(
        "bench-remote-code-oracle",
        BENCH.replace("{T}", "{REMOTE}") + " --oracle-acceptance 0.8",
        "--trust-remote-code",
    ),
    c("bench-sweep-k-negative", BENCH + " --drafter {MED} --sweep-k 1,-2", "--sweep-k"),
    c("bench-oracle-acceptance-high", BENCH + " --oracle-acceptance 1.5", "--oracle-acceptance"),
    c("bench-window-zero", BENCH + " --drafter {MED} --window 0", "--window"),
    c(
        "bench-max-new-tokens-past-context",
        BENCH.replace("--max-new-tokens 4", "--max-new-tokens 100000") + " --drafter {MED}",
        "context",
        owner="B",
    ),
    c(
        "bench-controller-is-medusa",
        "ds bench controller --controller {MED} --target {T} --prompts {PROMPTS} "
        "--num-prompts 1 --max-new-tokens 4 --dtype fp32",
        "medusa",
    ),
    c(
        "bench-controller-two",
        "ds bench controller --controller {MED},{MED} --target {T}",
        "reward",
    ),
    c(
        "bench-reward-unknown",
        "ds bench reward --target {T} --reward nosuch.module:fn --num-prompts 1 "
        "--samples-per-prompt 2 --max-new-tokens 2 --dtype fp32",
        "nosuch",
    ),
    c(
        "bench-reward-prompts-missing",
        "ds bench reward --target {T} --prompts {S}/nosuch.jsonl --num-prompts 1 --dtype fp32",
        "nosuch",
    ),
    c(
        "bench-diffusion-not-diffusion",
        "ds bench diffusion --target {T} --num-prompts 1 --gen-length 32",
        "diffusion",
    ),
    c(
        "bench-diffusion-threshold",
        "ds bench diffusion --target {T} --threshold 1.5",
        "--threshold",
    ),
    c(
        "bench-mode-flag-elsewhere",
        "ds bench controller --controller {MED} --engine-parity",
        "--engine-parity",
    ),
    c(
        "bench-sigint",
        BENCH.replace("--max-new-tokens 4", "--max-new-tokens 300")
        + " --drafter {MED} --out {S}/b",
        "interrupted",
        expect="interrupt",
        sigint_on="forward curve",
        sigint_after=0.2,
        protect=("{MED}",),
    ),
]

ENGINES = [
    c("engine-check-medusa", "ds engine-check {MED}", "medusa"),
    c("engine-check-missing", "ds engine-check {S}/nosuch", "nosuch"),
    c("engine-check-target", "ds engine-check {T}", "export"),
    c("engine-check-draft-n-max-zero", "ds engine-check {EA3} --draft-n-max 0", "--draft-n-max"),
    c(
        "engine-check-gguf-users-folder",
        "ds engine-check {EA3} --gguf {S}/mine",
        "mine",
        setup=(file("{S}/mine/notes.txt"),),
        protect=("{S}/mine",),
    ),
    c(
        "engine-check-out-is-export",
        "ds engine-check {EA3} --out {EA3}/config.json",
        "--out",
        protect=("{EA3}",),
    ),
    c("calibrate-medusa", "ds calibrate --drafter {MED} --out {S}/c --num-prompts 1", "specdecpp"),
    c("calibrate-missing", "ds calibrate --drafter {S}/nosuch --out {S}/c", "nosuch"),
    c(
        "calibrate-out-file",
        "ds calibrate --drafter {MED} --out {S}/f",
        "file",
        setup=(file("{S}/f"),),
        protect=("{S}/f",),
    ),
    c(
        "calibrate-out-is-drafter",
        "ds calibrate --drafter {S}/m --out {S}/m",
        "--out",
        setup=(copy("{MED}", "{S}/m"),),
        protect=("{S}/m",),
    ),
    c(
        "calibrate-out-read-only",
        "ds calibrate --drafter {MED} --out {S}/ro/c",
        "--out",
        setup=(("ro", "{S}/ro"),),
    ),
    c("calibrate-bins-zero", "ds calibrate --drafter {MED} --out {S}/c --bins 0", "--bins"),
]


CASES = [*BENCH_CASES, *ENGINES]
