"""Fault cases of serving an export: generate, and the exports the serving commands read
(config.json schema, part names, weights). Bench, calibrate and engine-check: cases_bench.py."""

from __future__ import annotations

from case import c, copy, edit, file, ok

GEN = "ds generate --prompt 'hello world' --max-new-tokens 4 --dtype fp32"
GT = GEN + " --target {T}"
M = "{S}/m/config.json"  # a case's own copy of the Medusa export


def _broken_export(id: str, changes: dict, *mentions: str, owner: str = "C1"):
    """generate with a copy of the Medusa export whose config.json got ``changes``."""
    return c(
        id,
        GT + " --drafter {S}/m",
        *mentions,
        setup=(copy("{MED}", "{S}/m"), edit(M, changes)),
        owner=owner,
    )


EXPORT_CONFIG = [
    _broken_export("export-arch-list", {"architecture": []}, "architecture"),
    _broken_export("export-arch-num-heads-str", {"architecture.num_heads": "two"}, "num_heads"),
    _broken_export("export-arch-hidden-float", {"architecture.hidden_size": 64.5}, "hidden_size"),
    _broken_export(
        "export-arch-missing-key", {"architecture.num_heads": None}, "architecture keys"
    ),
    _broken_export("export-format-version-str", {"format_version": "abc"}, "format_version"),
    _broken_export("export-format-version-future", {"format_version": 99}, "format_version"),
    _broken_export("export-format-other", {"format": "vllm"}, "format"),
    _broken_export("export-method-unknown", {"method": "banana"}, "banana"),
    _broken_export("export-method-int", {"method": 3}, "method"),
    _broken_export("export-target-str", {"target": "x"}, "target"),
    _broken_export("export-target-vocab-str", {"target.vocab_size": "many"}, "vocab_size"),
    _broken_export("export-inference-list", {"inference": [1, 2]}, "inference"),
    _broken_export("export-verifier-unknown", {"inference.verifier": "banana"}, "verifier"),
    _broken_export(
        "export-stop-policy-bad", {"inference.stop_policy": {"kind": "banana"}}, "stop_policy"
    ),
    _broken_export("export-tree-bad", {"inference.tree": "not a tree"}, "tree"),
    _broken_export("export-parts-list", {"parts": ["model"]}, "parts"),
    _broken_export("export-part-outside", {"parts.model.file": "../../chat.jsonl"}, "outside"),
    _broken_export("export-part-absolute", {"parts.model.file": "/etc/hostname"}, "outside"),
    _broken_export(
        "export-part-name-dots", {"parts": {"../x": {"file": "model.safetensors"}}}, "part"
    ),
    _broken_export("export-identity-str", {"identity": "abc"}, "identity"),
    c(
        "export-config-not-json",
        GT + " --drafter {S}/m",
        "JSON",
        setup=(copy("{MED}", "{S}/m"), file(M, "{not json")),
    ),
    c(
        "export-config-array",
        GT + " --drafter {S}/m",
        "config.json",
        setup=(copy("{MED}", "{S}/m"), file(M, "[1]")),
    ),
    c(
        "export-nan-weights",
        GT + " --drafter {S}/m",
        "NaN",
        setup=(copy("{MED}", "{S}/m"), ("nan", "{S}/m/model.safetensors")),
    ),
    c(
        "export-weights-truncated",
        GT + " --drafter {S}/m",
        "model.safetensors",
        setup=(copy("{MED}", "{S}/m"), ("truncate", "{S}/m/model.safetensors", 100)),
    ),
    c(
        "export-weights-missing",
        GT + " --drafter {S}/m",
        "model.safetensors",
        setup=(copy("{MED}", "{S}/m"), ("rm", "{S}/m/model.safetensors")),
    ),
    c(
        "export-weights-empty",
        GT + " --drafter {S}/m",
        "model.safetensors",
        setup=(copy("{MED}", "{S}/m"), file("{S}/m/model.safetensors", "")),
    ),
]

GENERATE = [
    ok("gen-ok-plain", GT),
    ok("gen-ok-medusa", GT + " --drafter {MED}"),
    c("gen-target-missing", GEN + " --target {S}/nosuch", "nosuch"),
    c("gen-target-file", GEN + " --target {DATA}", "chat.jsonl"),
    c("gen-target-empty-dir", GEN + " --target {EMPTY}", "empty"),
    c("gen-target-is-export", GEN + " --target {MED}", "export", owner="C1"),
    c("gen-target-is-speculators", GEN + " --target {SPEC}", "speculators"),
    c("gen-remote-code", GEN + " --target {REMOTE}", "--trust-remote-code"),
    c("gen-remote-code-yes-stdin", GEN + " --target {REMOTE}", "--trust-remote-code", stdin="y\n"),
    c(
        "gen-target-config-corrupt",
        GEN + " --target {S}/t",
        "config.json",
        setup=(copy("{T}", "{S}/t"), file("{S}/t/config.json", "{oops")),
    ),
    c(
        "gen-target-weights-truncated",
        GEN + " --target {S}/t",
        "safetensors",
        setup=(copy("{T}", "{S}/t"), ("truncate", "{S}/t/model.safetensors", 1000)),
    ),
    c(
        "gen-target-no-tokenizer",
        GEN + " --target {S}/t",
        "tokenizer",
        setup=(
            copy("{T}", "{S}/t"),
            ("rm", "{S}/t/tokenizer.json"),
            ("rm", "{S}/t/tokenizer_config.json"),
        ),
    ),
    c(
        "gen-target-no-weights",
        GEN + " --target {S}/t",
        "safetensors",
        setup=(copy("{T}", "{S}/t"), ("rm", "{S}/t/model.safetensors")),
    ),
    c("gen-drafter-missing", GT + " --drafter {S}/nosuch", "nosuch"),
    c("gen-drafter-file", GT + " --drafter {MED}/config.json", "file"),
    c("gen-drafter-is-target", GT + " --drafter {T}", "target model folder"),
    c("gen-drafter-is-speculators", GT + " --drafter {SPEC}", "speculators", "draftsmith import"),
    c("gen-drafter-is-vllm-medusa", GT + " --drafter {VLLM}", "medusa", "converted"),
    c("gen-drafter-empty-dir", GT + " --drafter {EMPTY}", "config.json"),
    c("gen-drafter-other-target", GEN + " --target {T2} --drafter {MED}", "hidden_size"),
    c("gen-controller-is-medusa", GT + " --controller {MED}", "medusa"),
    c(
        "gen-prompt-empty",
        "ds generate --prompt '' --max-new-tokens 4 --dtype fp32 --target {T}",
        "prompt",
    ),
    c(
        "gen-max-new-tokens-huge",
        GT.replace("--max-new-tokens 4", "--max-new-tokens 1000000000"),
        "context",
        owner="B",
    ),
    c(
        "gen-max-new-tokens-past-context",
        GT.replace("--max-new-tokens 4", "--max-new-tokens 5000"),
        "context",
        owner="B",
    ),
    c(
        "gen-max-new-tokens-zero",
        GT.replace("--max-new-tokens 4", "--max-new-tokens 0"),
        "--max-new-tokens",
    ),
    c("gen-temperature-negative", GT + " --temperature -1", "--temperature"),
    c("gen-dtype-fp16", GEN.replace("fp32", "fp16") + " --target {T}", "fp16"),
    c("gen-seed-negative", GT + " --seed -3", "--seed"),
    c("gen-proposer-option-bad", GT + " --drafter {MED} --proposer-option depth", "depth"),
    c("gen-proposer-option-unknown", GT + " --drafter {MED} --proposer-option banana=1", "banana"),
    c("gen-proposer-option-tree", GT + " --drafter {MED} --proposer-option 'tree=[[9]]'", "tree"),
    c("gen-stop-policy-bad", GT + " --drafter {MED} --stop-policy fixed:-1", "--stop-policy"),
    ok(
        "gen-ok-typical-at-zero", GT + " --drafter {MED} --verifier typical"
    ),  # clamped to T=1e-5: greedy
    c("gen-backend-bad", GT + " --backend x", "--backend"),
    c("gen-learned-stop-no-head", GT + " --drafter {MED} --stop-policy learned:0.5", "learned"),
    c("gen-unknown-flag", GT + " --nosuch 3", "--nosuch"),
    c(
        "gen-sigint",
        GT.replace("--max-new-tokens 4", "--max-new-tokens 400") + " --backend hf --verbose",
        "interrupted",
        expect="interrupt",
        sigint_on=r"\[dtype\]",
        sigint_after=0.0,
    ),
]


CASES = [*EXPORT_CONFIG, *GENERATE]
