"""Training-side commands: train, bench-train, cache-features (Hydra overrides after the name), export, assets."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence


def _cmd_train(argv: Sequence[str]) -> int:
    from draftsmith.train import expand_shorthands
    from draftsmith.train import main as hydra_main

    sys.argv = ["draftsmith train", *expand_shorthands(list(argv))]
    hydra_main()
    return 0


def compose_config(overrides: Sequence[str]):
    """Compose ``conf/train.yaml`` with Hydra overrides outside a Hydra app (bench-train, tests)."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def _cmd_bench_train(argv: Sequence[str]) -> int:
    """``draftsmith bench-train recipe=NAME [overrides] [--steps N] [--out FILE.json]``."""
    from pathlib import Path

    from draftsmith import recipes
    from draftsmith.distill.bench_train import bench_train

    parser = argparse.ArgumentParser(prog="draftsmith bench-train")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None)
    opts, overrides = parser.parse_known_args(argv)
    from draftsmith.train import expand_shorthands

    cfg = compose_config(expand_shorthands(overrides))
    result = bench_train(cfg, recipes.get_recipe(cfg.recipe.name), steps=opts.steps, warmup=opts.warmup)
    text = json.dumps(result, indent=2)
    print(text)
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(text + "\n")
    return 0


def _cmd_cache_features(argv: list[str]) -> int:
    """``draftsmith cache-features recipe=NAME [overrides] --out DIR [--dtype bf16|fp32] [--shard-mb N]``: run the
    target once over the data and write the features the recipe taps (:mod:`draftsmith.distill.feature_cache`).
    Lives in the CLI, not in distill/, because composing configs (Hydra) and picking recipes is the entry points'
    job."""
    import argparse

    from draftsmith import recipes
    from draftsmith.distill.feature_cache import build_cache
    from draftsmith.train import expand_shorthands, purposeful_errors, report_error

    parser = argparse.ArgumentParser(prog="draftsmith cache-features")
    parser.add_argument("--out", required=True, help="cache folder (a re-run resumes there)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="stored feature dtype")
    parser.add_argument("--shard-mb", type=float, default=1024.0, help="about this many MB per shard")
    opts, overrides = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = compose_config(expand_shorthands(overrides))
        manifest = build_cache(cfg, recipes.get_recipe(cfg.recipe.name), opts.out, dtype=opts.dtype,
                               shard_bytes=int(opts.shard_mb * 1e6))
    except purposeful_errors() as err:
        report_error(err)
        return 1
    print(json.dumps({k: manifest[k] for k in ("fingerprint", "bytes_per_token", "tokens", "batches")}, indent=2))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from draftsmith.distill.exporting import export_from_checkpoint
    from draftsmith.export.format import CONFIG_FILE, read_config

    src = args.source
    if args.format == "draftsmith":
        if (Path(src) / CONFIG_FILE).is_file():
            raise ValueError(f"{src} is already a draftsmith export; export takes a run folder or .ckpt file, or "
                             "converts an export with --format medusa|speculators")
        out = export_from_checkpoint(src, args.out)
    elif (Path(src) / CONFIG_FILE).is_file():
        out = _convert(src, args.out, args.format, read_config(src), args.target, source=src, quant=args.quantize)
    else:  # a run folder or checkpoint: export it into a temporary folder, removed whatever happens
        import tempfile

        parent = Path(args.out).resolve().parent
        with tempfile.TemporaryDirectory(prefix=".draftsmith-export-", dir=parent if parent.is_dir() else None) as tmp:
            export_dir = export_from_checkpoint(src, Path(tmp) / "export")
            out = _convert(export_dir, args.out, args.format, read_config(export_dir), args.target, source=src,
                           quant=args.quantize)
    print(f"wrote {out}")
    return 0


def _verifier_folder(config: dict, target: str | None) -> str:
    """The target a converted export names: ``--target`` or the export's record, aliases resolved to their folder.

    A local folder is written as its absolute path (what vLLM/speculators can load); anything else (a hub id) as is.
    A local folder is checked against the export's recorded identity, so a converted drafter never names a verifier
    it was not trained for.
    """
    from pathlib import Path

    from draftsmith import assets

    given = target or str(config["target"]["name_or_path"])
    folder = Path(assets.resolve_target(given)).expanduser()
    if not folder.is_dir():
        return given
    from transformers import AutoConfig, AutoTokenizer

    from draftsmith.export.format import check_target
    from draftsmith.export.identity import decoder_identity, target_identity
    from draftsmith.runtime.target.weights import load_lm_head

    lm_head = load_lm_head(folder)
    try:
        identity = target_identity(given, AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder),
                                   lm_head)
    except (OSError, ValueError):  # a weights-only folder (no tokenizer): check what the weights show
        from draftsmith.runtime.target.weights import load_hf_config

        hf = load_hf_config(folder)
        identity = decoder_identity(given, hf.get("hidden_size"), hf.get("num_hidden_layers"), lm_head)
    check_target(config, identity, given=given)
    return str(folder.resolve())


def _convert(export_dir, out, fmt: str, config: dict, target: str | None, source: str | None = None,
             quant: str | None = None):
    """Convert ``export_dir`` to ``fmt``; errors and the converted folder name ``source`` (what the user passed)."""
    from draftsmith.common.methods import METHODS, export_formats

    source = str(source or export_dir)
    method = METHODS.get(config.get("method"))
    if method is not None and fmt not in method.formats:  # the one method table says which converters apply
        hint = " (llama.cpp's --spec-type runs DFlash and EAGLE-3 drafters only)" if fmt == "gguf" else ""
        raise ValueError(f"{source}: --format {fmt} does not hold {method.name!r} exports{hint}; {method.label} "
                         f"exports as: {', '.join(method.formats)}")
    if fmt in ("medusa", "medusa-tgi"):
        from draftsmith.export.medusa_layout import to_medusa_layout
        from draftsmith.export.medusa_tgi import to_medusa_tgi
        from draftsmith.runtime.target.weights import load_lm_head

        # Heads sharing the target's LM head need it: default to the recorded target like speculators does.
        # TGI loads the base model the config names: the target, always.
        shared = bool(config["architecture"].get("share_lm_head", False))
        base = _verifier_folder(config, target) if target or shared or fmt == "medusa-tgi" else None
        lm_head = load_lm_head(base) if target or shared else None
        if fmt == "medusa-tgi":
            return to_medusa_tgi(export_dir, out, base, lm_head, source=source)
        return to_medusa_layout(export_dir, out, lm_head, source=source)
    if fmt == "speculators":
        from draftsmith.export.speculators import to_speculators

        return to_speculators(export_dir, out, _verifier_folder(config, target), source=source)
    if fmt == "dflash-zlab":
        from draftsmith.export.dflash import to_zlab

        return to_zlab(export_dir, out, source=source)
    if fmt == "sglang":
        from draftsmith.export.sglang import to_sglang

        return to_sglang(export_dir, out, source=source)
    if fmt == "gguf":
        return _to_gguf(export_dir, out, _verifier_folder(config, target), quant, source)
    raise ValueError(f"unknown --format {fmt!r}; valid: {', '.join(export_formats())}")


def _to_gguf(export_dir, out, target_folder: str, quant: str | None, source: str):
    """``--format gguf``: the cached llama.cpp build converts the drafter (and the target, cached once as BF16)."""
    from draftsmith.bench import llamacpp
    from draftsmith.export.gguf import to_gguf

    reason = llamacpp.missing_build_reason()
    if reason:
        raise ValueError(f"--format gguf runs llama.cpp's own converter, which is {reason}")
    return to_gguf(export_dir, out, target_folder, llamacpp.llamacpp_dir(), llamacpp.bf16_gguf(target_folder),
                   quant=quant, source=source)


def _cmd_assets(args: argparse.Namespace) -> int:
    from draftsmith import assets

    target = assets.default_target_dir()
    conversations, report = assets.read_sharegpt(assets.sharegpt_path())
    questions = assets.mtbench_questions()
    print(json.dumps({"target": str(target), "sharegpt": {"kept": report.kept, "skipped": report.skipped,
                                                          "turns": report.turns, "reason": report.reason},
                      "mtbench_questions": len(questions)}, indent=2))
    return 0


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="run folder (holding checkpoints/last.ckpt), .ckpt file, or export folder")
    p.add_argument("--out", required=True, help="output folder")
    from draftsmith.common.methods import export_formats

    p.add_argument("--format", default="draftsmith", choices=export_formats())
    p.add_argument("--target", default=None, help="target folder or alias for converters (default: the target the "
                   "export records); speculators writes its absolute folder path as the verifier")
    p.add_argument("--quantize", default=None, metavar="QTYPE", help="--format gguf: also write the target "
                   "quantised with llama-quantize (Q4_1, Q8_0, ...); the drafter stays BF16")


ARGUMENTS = {"export": _export_arguments}
HANDLERS = {"export": _cmd_export, "assets": _cmd_assets}
RAW_HANDLERS = {"train": _cmd_train, "bench-train": _cmd_bench_train, "cache-features": _cmd_cache_features}
