"""Fault cases of the commands that write or read exports: export (every format) and import."""

from __future__ import annotations

from case import c, copy, edit, file, ok

SPEC_CFG = "{S}/spec/config.json"

EXPORT = [
    ok("export-ok-run", "ds export {RUN} --out {S}/e"),
    ok("export-ok-medusa-layout", "ds export {MED} --out {S}/v --format medusa"),
    c(
        "export-out-is-run",
        "ds export {S}/run --out {S}/run",
        "source",
        setup=(copy("{RUN}", "{S}/run"),),
        protect=("{S}/run",),
    ),
    c(
        "export-out-inside-run",
        "ds export {S}/run --out {S}/run/checkpoints",
        "source",
        setup=(copy("{RUN}", "{S}/run"),),
        protect=("{S}/run",),
    ),
    c(
        "export-out-holds-source",
        "ds export {S}/p/m --out {S}/p --format medusa",
        "source",
        setup=(copy("{MED}", "{S}/p/m"),),
        protect=("{S}/p",),
    ),
    c(
        "export-out-users-folder",
        "ds export {RUN} --out {S}/mine",
        "mine",
        setup=(file("{S}/mine/keep.txt"),),
        protect=("{S}/mine",),
    ),
    c(
        "export-out-file",
        "ds export {RUN} --out {S}/f",
        "file",
        setup=(file("{S}/f"),),
        protect=("{S}/f",),
    ),
    c("export-out-read-only", "ds export {RUN} --out {S}/ro/e", "--out", setup=(("ro", "{S}/ro"),)),
    c(
        "export-out-full-disk",
        "ds export {RUN} --out {S}/full/e",
        "space",
        setup=(("full", "{S}/full", 64),),
    ),
    c(
        "export-out-is-target",
        "ds export {RUN} --out {S}/t",
        "t",
        setup=(copy("{T}", "{S}/t"),),
        protect=("{S}/t",),
    ),
    c("export-source-missing", "ds export {S}/nosuch --out {S}/e", "nosuch"),
    c("export-source-already-export", "ds export {MED} --out {S}/e", "already"),
    c("export-source-empty-dir", "ds export {EMPTY} --out {S}/e", "checkpoint"),
    c(
        "export-ckpt-truncated",
        "ds export {S}/run --out {S}/e",
        "last.ckpt",
        setup=(copy("{RUN}", "{S}/run"), ("truncate", "{S}/run/checkpoints/last.ckpt", 200)),
    ),
    c(
        "export-ckpt-garbage",
        "ds export {S}/run --out {S}/e",
        "last.ckpt",
        setup=(copy("{RUN}", "{S}/run"), file("{S}/run/checkpoints/last.ckpt", "not a checkpoint")),
    ),
    c("export-format-mismatch", "ds export {MED} --out {S}/e --format speculators", "speculators"),
    c("export-format-gguf-no-build", "ds export {MED} --out {S}/e --format gguf", "gguf"),
    c("export-format-unknown", "ds export {MED} --out {S}/e --format banana", "--format"),
    c(
        "export-nan-to-layout",
        "ds export {S}/m --out {S}/e --format medusa",
        "NaN",
        setup=(copy("{MED}", "{S}/m"), ("nan", "{S}/m/model.safetensors")),
    ),
    c(
        "export-bad-config-to-layout",
        "ds export {S}/m --out {S}/e --format medusa",
        "num_heads",
        setup=(
            copy("{MED}", "{S}/m"),
            edit("{S}/m/config.json", {"architecture.num_heads": "two"}),
        ),
    ),
]

IMPORT = [
    ok("import-ok", "ds import {SPEC} --out {S}/i --target {T}"),
    c(
        "import-out-is-source",
        "ds import {S}/spec --out {S}/spec --target {T}",
        "source",
        setup=(copy("{SPEC}", "{S}/spec"),),
        protect=("{S}/spec",),
    ),
    c(
        "import-out-users-folder",
        "ds import {SPEC} --out {S}/mine --target {T}",
        "mine",
        setup=(file("{S}/mine/keep.txt"),),
        protect=("{S}/mine",),
    ),
    c("import-missing", "ds import {S}/nosuch --out {S}/i --target {T}", "nosuch"),
    c("import-target-folder", "ds import {T} --out {S}/i --target {T}", "model folder"),
    c("import-draftsmith-export", "ds import {MED} --out {S}/i --target {T}", "draftsmith export"),
    c("import-vllm-medusa", "ds import {VLLM} --out {S}/i --target {T}", "medusa"),
    c(
        "import-config-weights-disagree",
        "ds import {S}/spec --out {S}/i --target {T}",
        "intermediate_size",
        setup=(
            copy("{SPEC}", "{S}/spec"),
            edit(SPEC_CFG, {"transformer_layer_config.intermediate_size": 96}),
        ),
    ),
    c(
        "import-heads-disagree",
        "ds import {S}/spec --out {S}/i --target {T}",
        "head_dim",
        setup=(
            copy("{SPEC}", "{S}/spec"),
            edit(
                SPEC_CFG,
                {
                    "transformer_layer_config.num_attention_heads": 8,
                    "transformer_layer_config.head_dim": None,
                },
            ),
        ),
    ),
    c(
        "import-draft-vocab-disagree",
        "ds import {S}/spec --out {S}/i --target {T}",
        "draft_vocab_size",
        setup=(copy("{SPEC}", "{S}/spec"), edit(SPEC_CFG, {"draft_vocab_size": 40})),
    ),
    c(
        "import-weights-truncated",
        "ds import {S}/spec --out {S}/i --target {T}",
        "model.safetensors",
        setup=(copy("{SPEC}", "{S}/spec"), ("truncate", "{S}/spec/model.safetensors", 300)),
    ),
    c(
        "import-weights-nan",
        "ds import {S}/spec --out {S}/i --target {T}",
        "NaN",
        setup=(copy("{SPEC}", "{S}/spec"), ("nan", "{S}/spec/model.safetensors")),
    ),
    c(
        "import-config-not-json",
        "ds import {S}/spec --out {S}/i --target {T}",
        "JSON",
        setup=(copy("{SPEC}", "{S}/spec"), file(SPEC_CFG, "{nope")),
    ),
    c(
        "import-config-layer-list",
        "ds import {S}/spec --out {S}/i --target {T}",
        "transformer_layer_config",
        setup=(copy("{SPEC}", "{S}/spec"), edit(SPEC_CFG, {"transformer_layer_config": [1]})),
    ),
    c(
        "import-no-type",
        "ds import {S}/spec --out {S}/i --target {T}",
        "speculators_model_type",
        setup=(copy("{SPEC}", "{S}/spec"), edit(SPEC_CFG, {"speculators_model_type": None})),
    ),
    c(
        "import-target-remote",
        "ds import {SPEC} --out {S}/i --target {REMOTE}",
        "--trust-remote-code",
    ),
    c("import-target-missing", "ds import {SPEC} --out {S}/i --target {S}/nosuch", "nosuch"),
    c("import-target-narrow", "ds import {SPEC} --out {S}/i --target {T2}", "hidden_size"),
]


CASES = [*EXPORT, *IMPORT]
