"""Training-side commands: train, bench-train, cache-features (Hydra overrides after the name), export, assets."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence


def _cmd_train(argv: Sequence[str]) -> int:
    """``draftsmith train [--help] recipe=NAME [overrides]``: as ``python train.py`` (train.run_command_line)."""
    from draftsmith.train import run_command_line

    run_command_line(list(argv), "draftsmith train")
    return 0


def compose_config(overrides: Sequence[str]):
    """Compose ``conf/train.yaml`` with Hydra overrides outside a Hydra app (bench-train, tests)."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    import draftsmith.recipes.schemas  # noqa: F401  (stores the config schemas conf/ names in Hydra's ConfigStore)

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def _cmd_bench_train(argv: Sequence[str]) -> int:
    """``draftsmith bench-train recipe=NAME [overrides] [--steps N] [--out FILE.json]``."""
    import sys
    from pathlib import Path

    from draftsmith import recipes
    from draftsmith.common.errors import ConfigError
    from draftsmith.distill.engine.bench_train import bench_train

    parser = argparse.ArgumentParser(prog="draftsmith bench-train")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None, help="FILE.json (and FILE.md beside it)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    opts, overrides = parser.parse_known_args(argv)
    from draftsmith.distill.engine.bench_train import markdown_table
    from draftsmith.train import expand_shorthands, preflight, purposeful_errors

    overrides = expand_shorthands(overrides)
    try:
        if (problem := preflight(overrides)) is not None:  # typos, types, ranges: before the target loads
            raise ConfigError(problem)
        cfg = compose_config(overrides)
        result = bench_train(cfg, recipes.get_recipe(cfg.recipe.name), steps=opts.steps, warmup=opts.warmup,
                             device=opts.device)
    except purposeful_errors() as err:
        print(f"draftsmith bench-train: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    text, table = json.dumps(result, indent=2), markdown_table(result)
    print(text)
    print(table)
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(text + "\n")
        Path(opts.out).with_suffix(".md").write_text(table + "\n")
    return 0


def _cmd_cache_features(argv: list[str]) -> int:
    """``draftsmith cache-features recipe=NAME [overrides] --out DIR [--dtype bf16|fp32] [--shard-mb N]``: run the
    target once over the data and write the features the recipe taps (:mod:`draftsmith.distill.feature_cache.build`).
    Lives in the CLI, not in distill/, because composing configs (Hydra) and picking recipes is the entry points'
    job."""
    import argparse

    from draftsmith import recipes
    from draftsmith.common.errors import ConfigError
    from draftsmith.distill.feature_cache.build import build_cache
    from draftsmith.train import expand_shorthands, preflight, purposeful_errors, report_error

    parser = argparse.ArgumentParser(prog="draftsmith cache-features")
    parser.add_argument("--out", required=True, help="cache folder (a re-run resumes there)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="stored feature dtype")
    parser.add_argument("--shard-mb", type=float, default=1024.0, help="about this many MB per shard")
    opts, overrides = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if (problem := preflight(expand_shorthands(overrides))) is not None:  # typos, types, ranges: before loading
            raise ConfigError(problem)
        cfg = compose_config(expand_shorthands(overrides))
        manifest = build_cache(cfg, recipes.get_recipe(cfg.recipe.name), opts.out, dtype=opts.dtype,
                               shard_bytes=int(opts.shard_mb * 1e6))
    except purposeful_errors() as err:
        report_error(err)
        return 1
    print(json.dumps({k: manifest[k] for k in ("fingerprint", "bytes_per_token", "tokens", "batches")}, indent=2))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    """``draftsmith export SOURCE --out DIR [--format F]``: a run folder or checkpoint -> a draftsmith export, or (any
    other format) -> that format's layout. ``--out`` is checked before any work: never the user's folder, never the
    source (:mod:`draftsmith.common.atomic_folder`); a run folder is exported into a temporary beside ``--out``."""
    from pathlib import Path

    from draftsmith.common.atomic_folder import scratch_folder
    from draftsmith.distill.engine.exporting import export_from_checkpoint
    from draftsmith.export.format import CONFIG_FILE, read_config

    src, is_export = args.source, (Path(args.source) / CONFIG_FILE).is_file()
    _check_out(args.out, src)
    options = {name: getattr(args, name) for name in _format_option_names()}
    if args.format == "draftsmith":
        if is_export:
            raise ValueError(f"{src} is already a draftsmith export; export takes a run folder or .ckpt file, or "
                             "converts an export with --format medusa|speculators|...")
        out = export_from_checkpoint(src, args.out)
    elif is_export:
        out = _convert(src, args.out, args.format, read_config(src), args.target, source=src, **options)
    else:  # a run folder or checkpoint: exported into a temporary folder beside --out, removed whatever happens
        with scratch_folder(args.out) as tmp:
            export_dir = export_from_checkpoint(src, tmp / "export")
            out = _convert(export_dir, args.out, args.format, read_config(export_dir), args.target, source=src,
                           **options)
    print(f"wrote {out}")
    return 0


def _check_out(out: str, source: str) -> None:
    """Refuse, before any work, an ``--out`` that is the source or a folder draftsmith did not write."""
    from draftsmith.common.atomic_folder import OutputRefused, check_folder_target
    from draftsmith.export.format import EXPORT_OUTPUT, ExportRefusedError

    try:
        check_folder_target(out, EXPORT_OUTPUT, sources=(source,))
    except OutputRefused as err:
        raise ExportRefusedError(str(err)) from None


def _format_option_names() -> list[str]:
    """The argparse dests the formats' own flags add (gguf's ``quantize``), read from the converters."""
    import argparse

    from draftsmith.export.converters import converters

    probe = argparse.ArgumentParser(add_help=False)
    for fmt in converters().values():
        if fmt.add_arguments is not None:
            fmt.add_arguments(probe)
    return [action.dest for action in probe._actions]


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


def _refuse_format(fmt: str, method: str | None, source: str) -> None:
    """One line when ``fmt`` does not hold ``method``'s exports, naming the formats that do (the converters say)."""
    from draftsmith.common.methods import METHODS
    from draftsmith.export.converters import formats_for, get_format

    holder = get_format(fmt)
    if method is None or holder.holds(method):
        return
    entry = METHODS.get(method)
    # the method table's order first (its row lists the formats the method is known by), then any converter it lacks
    listed = dict.fromkeys([*(entry.formats if entry else ()), *formats_for(method)])
    raise ValueError(f"{source}: --format {fmt} does not hold {method!r} exports{holder.refusal_hint}; "
                     f"{entry.label if entry else method} exports as: {', '.join(listed)}")


class _CliHost:
    """What converters ask of the command line (:class:`draftsmith.export.converters.ConverterHost`)."""

    def verifier_folder(self, config: dict, target: str | None) -> str:
        return _verifier_folder(config, target)

    def lm_head(self, folder: str):
        from draftsmith.runtime.target.weights import load_lm_head

        return load_lm_head(folder)

    def llamacpp(self, target_folder: str):
        from draftsmith.bench import llamacpp

        reason = llamacpp.missing_build_reason()
        if reason:
            raise ValueError(f"--format gguf runs llama.cpp's own converter, which is {reason}")
        return llamacpp.llamacpp_dir(), llamacpp.bf16_gguf(target_folder)


def _to_gguf(export_dir, out, target_folder: str, quant: str | None, source: str):
    """``--format gguf`` without the format check: the cached llama.cpp build converts drafter and target."""
    from draftsmith.export.gguf import to_gguf

    root, target_gguf = _CliHost().llamacpp(target_folder)
    return to_gguf(export_dir, out, target_folder, root, target_gguf, quant=quant, source=source)


def _convert(export_dir, out, fmt: str, config: dict, target: str | None, source: str | None = None, **options):
    """Convert ``export_dir`` to ``fmt`` through the converter that declares it (:mod:`draftsmith.export.converters`);
    errors and the converted folder name ``source`` (what the user passed); ``options``: the format's own flags."""
    from pathlib import Path

    from draftsmith.export.converters import ConvertRequest, get_format

    source = str(source or export_dir)
    _refuse_format(fmt, config.get("method"), source)
    request = ConvertRequest(Path(export_dir), Path(out), config, source, target, _CliHost(), options)
    return get_format(fmt).convert(request)


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
    p.add_argument("--out", required=True, help="output folder (new, or one draftsmith wrote; never the source)")
    from draftsmith.export.converters import converters, export_formats

    formats = converters()
    p.add_argument("--format", default="draftsmith", choices=export_formats(), help="draftsmith (the export) or: "
                   + "; ".join(f"{name}: {fmt.help}" for name, fmt in formats.items()))
    p.add_argument("--target", default=None, help="target folder or alias for converters (default: the target the "
                   "export records); speculators writes its absolute folder path as the verifier")
    for fmt in formats.values():  # flags a format declares for itself (gguf: --quantize)
        if fmt.add_arguments is not None:
            fmt.add_arguments(p)


ARGUMENTS = {"export": _export_arguments}
HANDLERS = {"export": _cmd_export, "assets": _cmd_assets}
RAW_HANDLERS = {"train": _cmd_train, "bench-train": _cmd_bench_train, "cache-features": _cmd_cache_features}
