"""Fault cases of training (train.py: config keys A, training-side faults C2), cache-features, curve
and bench-train. ``{TINY}`` is a tiny run's overrides (fp32, 48 tokens, 2 steps, a checkpoint every
step).
"""

from __future__ import annotations

from case import c, copy, file, ok

TRAIN = "train recipe=medusa target={T} data={DATA} {TINY}"
RUN_DIR = "hydra.run.dir={S}/run"
FEAT = (
    "ds cache-features recipe=eagle3 target={T} data={DATA} data.limit=4 data.max_length=32"
    " target.dtype=fp32"
)
CURVE = "ds curve --steps 4 --first-steps 2 --points 2 --num-prompts 1 --max-new-tokens 4"

CONFIG = [  # refused before anything loads (helper A)
    ok("train-ok", TRAIN, owner="A", timeout=400),
    c("train-recipe-unknown", "train recipe=banana", "banana", owner="A"),
    c("train-recipe-missing", "train target={T}", "recipe", owner="A"),
    c(
        "train-recipe-twice",
        "train recipe=medusa recipe=hydra target={T} data={DATA} {TINY}",
        "recipe",
        owner="A",
    ),
    c("train-key-typo", TRAIN + " heads.num_head=4", "heads.num_heads", owner="A"),
    c("train-key-plus-typo", TRAIN + " +heads.num_head=4", "num_head", owner="A"),
    c("train-max-time-word", TRAIN + " trainer.max_time=tomorrow", "max_time", owner="A"),
    c("train-precision-banana", TRAIN + " trainer.precision=banana", "precision", owner="A"),
    c("train-ddp-zero-devices", TRAIN + " trainer=ddp trainer.devices=0", "devices", owner="A"),
    c("train-max-steps-negative", TRAIN + " trainer.max_steps=-5", "max_steps", owner="A"),
    c("train-lr-negative", TRAIN + " optim.lr=-1", "optim.lr", owner="A"),
    c("train-lr-string", TRAIN + " optim.lr=fast", "optim.lr", owner="A"),
    c("train-scheduler-unknown", TRAIN + " optim.scheduler=banana", "scheduler", owner="A"),
    c("train-limit-zero", TRAIN + " data.limit=0", "data.limit", owner="A"),
    c("train-batch-zero", TRAIN + " data.batch_size=0", "batch_size", owner="A"),
    c("train-max-length-one", TRAIN + " data.max_length=1", "max_length", owner="A"),
    c("train-val-fraction-one", TRAIN + " data.val_fraction=1.5", "val_fraction", owner="A"),
    c("train-num-heads-zero", TRAIN + " heads.num_heads=0", "num_heads", owner="A"),
    c(
        "train-checkpoint-every-zero",
        TRAIN + " run.checkpoint_every=0",
        "checkpoint_every",
        owner="A",
    ),
    c("train-keep-zero", TRAIN + " run.keep_checkpoints=0", "keep_checkpoints", owner="A"),
    c("train-labels-unknown", TRAIN + " distill.labels=banana", "labels", owner="A"),
    c("train-logger-unknown", TRAIN + " logger=banana", "logger", owner="A"),
    c("train-trainer-unknown", TRAIN + " trainer=banana", "trainer", owner="A"),
    c(
        "train-served-tau-prompts-zero",
        TRAIN + " validation.served_tau.every=1 validation.served_tau.prompts=0",
        "prompts",
        owner="A",
    ),
    c(
        "train-served-tau-prompt-set",
        TRAIN + " validation.served_tau.every=1 validation.served_tau.prompt_set=nosuch",
        "nosuch",
        owner="A",
    ),
]

INPUTS = [  # data, target and run folder (helpers C2 and A)
    c(
        "train-data-missing",
        "train recipe=medusa target={T} data={S}/nosuch.jsonl {TINY}",
        "nosuch",
        owner="C2",
    ),
    c(
        "train-data-empty-dir",
        "train recipe=medusa target={T} data={EMPTY} {TINY}",
        "empty",
        owner="C2",
    ),
    # a data folder trains on every data file in it (.jsonl/.json/.parquet) and names the others in
    # one warning (tests/test_data_loading.py), by design: a control, not a refusal
    ok(
        "train-data-mixed-dir",
        "train recipe=medusa target={T} data={S}/d {TINY}",
        setup=(
            copy("{DATA}", "{S}/d/a.jsonl"),
            ("copy", "{BIN}", "{S}/d/b.png"),
            file("{S}/d/c.txt", "x"),
        ),
        owner="C2",
    ),
    c(
        "train-data-binary",
        "train recipe=medusa target={T} data={S}/d.jsonl {TINY}",
        "d.jsonl",
        setup=(("copy", "{BIN}", "{S}/d.jsonl"),),
        owner="C2",
    ),
    c(
        "train-data-bad-json",
        "train recipe=medusa target={T} data={S}/d.jsonl {TINY}",
        "d.jsonl",
        setup=(file("{S}/d.jsonl", '{"conversations": [\n'),),
        owner="C2",
    ),
    c(
        "train-target-missing",
        "train recipe=medusa target={S}/nosuch data={DATA} {TINY}",
        "nosuch",
        owner="C2",
    ),
    c(
        "train-target-remote",
        "train recipe=medusa target={REMOTE} data={DATA} {TINY}",
        "trust_remote_code",
        owner="C2",
    ),
    c(
        "train-target-is-export",
        "train recipe=medusa target={MED} data={DATA} {TINY}",
        "export",
        owner="C2",
    ),
    c(
        "train-run-dir-file",
        TRAIN + " hydra.run.dir={S}/f",
        "hydra.run.dir",
        setup=(file("{S}/f"),),
        protect=("{S}/f",),
        owner="A",
    ),
    c(
        "train-run-dir-read-only",
        TRAIN + " hydra.run.dir={S}/ro/run",
        "hydra.run.dir",
        setup=(("ro", "{S}/ro"),),
        owner="A",
    ),
    c(
        "train-run-dir-is-data-dir",
        "train recipe=medusa target={T} data={S}/d/a.jsonl {TINY} hydra.run.dir={S}/d",
        "hydra.run.dir",
        setup=(copy("{DATA}", "{S}/d/a.jsonl"),),
        protect=("{S}/d",),
        owner="A",
    ),
    c(
        "train-run-dir-is-target",
        TRAIN + " hydra.run.dir={S}/t",
        "hydra.run.dir",
        setup=(copy("{T}", "{S}/t"),),
        protect=("{S}/t",),
        owner="A",
    ),
]

RESUME = [  # a run folder trained once, then a second command in it (helper C2)
    c(
        "resume-lr-changed",
        TRAIN + " " + RUN_DIR + " trainer.max_steps=3 optim.lr=0.5",
        "optim.lr",
        setup=(("run", TRAIN + " " + RUN_DIR),),
        owner="C2",
        timeout=400,
    ),
    c(
        "resume-data-changed",
        "train recipe=medusa target={T} data={S}/d2.jsonl {TINY} "
        + RUN_DIR
        + " trainer.max_steps=3",
        "data",
        setup=(("run", TRAIN + " " + RUN_DIR), copy("{DATA}", "{S}/d2.jsonl")),
        owner="C2",
        timeout=400,
    ),
    c(
        "resume-other-recipe",
        "train recipe=hydra target={T} data={DATA} {TINY} " + RUN_DIR,
        "recipe",
        setup=(("run", TRAIN + " " + RUN_DIR),),
        owner="C2",
        timeout=400,
    ),
    ok(
        "resume-keeps-metrics",
        TRAIN + " " + RUN_DIR + " trainer.max_steps=3",
        setup=(("run", TRAIN + " " + RUN_DIR),),
        protect=("append:{S}/run/logs/metrics.csv",),
        owner="C2",
        timeout=400,
    ),
    ok(
        "resume-truncated-last-ckpt",
        TRAIN + " " + RUN_DIR + " trainer.max_steps=3",
        setup=(("run", TRAIN + " " + RUN_DIR), ("truncate", "{S}/run/checkpoints/last.ckpt", 500)),
        owner="C2",
        timeout=400,
    ),
    c(
        "train-sigint",
        TRAIN.replace("trainer.max_steps=2", "trainer.max_steps=400") + " " + RUN_DIR,
        "interrupted",
        expect="interrupt",
        sigint_on=r"checkpoint step2\.ckpt",
        rerun=TRAIN + " " + RUN_DIR + " trainer.max_steps=3",
        owner="C2",
        timeout=400,
    ),
]

FEATURES = [
    c("features-shard-mb-zero", FEAT + " --out {S}/c --shard-mb 0", "--shard-mb"),
    c("features-shard-mb-negative", FEAT + " --out {S}/c --shard-mb -5", "--shard-mb"),
    c("features-shard-mb-nan", FEAT + " --out {S}/c --shard-mb nan", "--shard-mb"),
    c(
        "features-out-file",
        FEAT + " --out {S}/f",
        "--out",
        setup=(file("{S}/f"),),
        protect=("{S}/f",),
    ),
    c("features-out-read-only", FEAT + " --out {S}/ro/c", "--out", setup=(("ro", "{S}/ro"),)),
    c(
        "features-out-users-folder",
        FEAT + " --out {S}/mine",
        "mine",
        setup=(file("{S}/mine/keep.txt"),),
        protect=("{S}/mine",),
    ),
    c(
        "features-out-is-target",
        FEAT + " --out {S}/t",
        "--out",
        setup=(copy("{T}", "{S}/t"),),
        protect=("{S}/t",),
    ),
    c("features-dtype-fp16", FEAT + " --out {S}/c --dtype fp16", "--dtype"),
    c("features-key-typo", FEAT + " --out {S}/c drafter.ttt_step=2", "ttt_step", owner="A"),
    c(
        "bench-train-steps-zero",
        "ds bench-train recipe=medusa target={T} data={DATA} {TINY} --steps 0",
        "--steps",
        owner="A",
    ),
    c(
        "bench-train-out-file",
        "ds bench-train recipe=medusa target={T} data={DATA} {TINY} --out {S}/f",
        "--out",
        setup=(file("{S}/f"),),
        protect=("{S}/f",),
        owner="A",
    ),
]

CURVES = [  # the curve command is C1's, its evaluation E's
    c(
        "curve-prompts-missing",
        CURVE + " --prompts nosuch --out {S}/c recipe=medusa target={T} data={DATA}",
        "nosuch",
        timeout=120,
    ),
    c(
        "curve-prompts-slice-bad",
        CURVE + " --prompts 'mtbench[9:1]' --out {S}/c recipe=medusa",
        "mtbench[9:1]",
        timeout=120,
    ),
    c(
        "curve-out-file",
        CURVE + " --out {S}/f recipe=medusa",
        "--out",
        setup=(file("{S}/f"),),
        protect=("{S}/f",),
    ),
    c(
        "curve-out-read-only",
        CURVE + " --out {S}/ro/c recipe=medusa",
        "--out",
        setup=(("ro", "{S}/ro"),),
    ),
    c(
        "curve-out-users-folder",
        CURVE + " --out {S}/mine recipe=medusa",
        "mine",
        setup=(file("{S}/mine/keep.txt"),),
        protect=("{S}/mine",),
    ),
    c(
        "curve-num-prompts-zero",
        CURVE.replace("--num-prompts 1", "--num-prompts 0") + " --out {S}/c recipe=medusa",
        "--num-prompts",
    ),
    c("curve-steps-zero", "ds curve --steps 0 --out {S}/c recipe=medusa", "--steps"),
    c("curve-points-zero", "ds curve --points 0 --out {S}/c recipe=medusa", "--points"),
    c(
        "curve-first-past-last",
        "ds curve --first-steps 50 --steps 10 --out {S}/c recipe=medusa",
        "--first-steps",
    ),
    c("curve-dtype-fp16", CURVE + " --dtype fp16 --out {S}/c recipe=medusa", "--dtype"),
    c("curve-compare-missing", "ds curve --compare {S}/a,{S}/b --out {S}/c", "curve"),
    c("curve-report-only-empty", "ds curve --report-only --out {EMPTY}", "curve.json"),
    c(
        "curve-key-typo",
        CURVE + " --out {S}/c recipe=medusa heads.num_head=3",
        "num_head",
        owner="A",
    ),
]

CASES = [*CONFIG, *INPUTS, *RESUME, *FEATURES, *CURVES]
