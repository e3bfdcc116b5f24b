"""The ``draftsmith`` command: train, export, assets, generate, bench, bench-train, and the diffusion ones
(diffusion-export, trajectories, diffusion-bench)."""

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

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parent / "conf"), version_base="1.3"):
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


def _cmd_export(args: argparse.Namespace) -> int:
    from draftsmith.distill.exporting import export_from_checkpoint
    from draftsmith.export.format import read_config

    src = args.source
    if args.format == "draftsmith":
        out = export_from_checkpoint(src, args.out)
    else:
        from pathlib import Path

        export_dir = Path(src)
        if not (export_dir / "config.json").is_file():  # a run folder or checkpoint: export it first
            export_dir = export_from_checkpoint(src, Path(args.out).with_name(Path(args.out).name + ".draftsmith"))
        out = _convert(export_dir, args.out, args.format, read_config(export_dir), args.target)
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


def _convert(export_dir, out, fmt: str, config: dict, target: str | None):
    if fmt == "medusa":
        from draftsmith.export.medusa_layout import to_medusa_layout
        from draftsmith.runtime.target.weights import load_lm_head

        # Heads sharing the target's LM head need it: default to the recorded target like speculators does.
        shared = bool(config["architecture"].get("share_lm_head", False))
        lm_head = load_lm_head(_verifier_folder(config, target)) if target or shared else None
        return to_medusa_layout(export_dir, out, lm_head)
    if fmt == "speculators":
        from draftsmith.export.speculators import to_speculators

        return to_speculators(export_dir, out, _verifier_folder(config, target))
    raise SystemExit(f"unknown --format {fmt!r}; valid: draftsmith, medusa, speculators")


def _cmd_assets(args: argparse.Namespace) -> int:
    from draftsmith import assets

    target = assets.default_target_dir()
    conversations, report = assets.read_sharegpt(assets.sharegpt_path())
    questions = assets.mtbench_questions()
    print(json.dumps({"target": str(target), "sharegpt": {"kept": report.kept, "skipped": report.skipped,
                                                          "turns": report.turns, "reason": report.reason},
                      "mtbench_questions": len(questions)}, indent=2))
    return 0


def _cmd_diffusion_export(args: argparse.Namespace) -> int:
    """A recipe=diffusion_adapt export (or run folder) -> an ordinary HF model folder that ``--target`` can name."""
    from draftsmith.runtime.target.diffusion_lm import folder_from_export

    print(f"wrote {folder_from_export(args.source, args.out)}")
    return 0


def _cmd_trajectories(args: argparse.Namespace) -> int:
    from draftsmith.runtime.tools.trajectories import run_cli

    print(json.dumps(run_cli(args), indent=2))
    return 0


def _cmd_diffusion_bench(args: argparse.Namespace) -> int:
    from draftsmith.runtime.bench.diffusion import run_cli

    run_cli(args)
    return 0


def _add_diffusion_subcommands(sub: argparse._SubParsersAction) -> None:
    """``diffusion-export``, ``trajectories`` and ``diffusion-bench`` (Learn2PD on block-diffusion targets)."""
    p = sub.add_parser("diffusion-export", help="turn a recipe=diffusion_adapt export into a HF model folder")
    p.add_argument("source", help="<run dir>/export (or the run folder)")
    p.add_argument("--out", required=True, help="output HF folder (written atomically)")
    for name, helptext in (("trajectories", "Learn2PD oracle trajectories of a diffusion target"),
                           ("diffusion-bench", "baseline vs Learn2PD vs EoTP block-diffusion decoding")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--target", required=True, help="block-diffusion target folder (recipe=diffusion_adapt's <run dir>/export)")
        p.add_argument("--prompts", default="mtbench", help="mtbench | sharegpt | a .txt/.jsonl file")
        p.add_argument("--limit", type=int, default=None, help="first N prompts")
        p.add_argument("--gen-length", type=int, default=256)
        p.add_argument("--steps-per-block", type=int, default=None, help="default: the block length (1 token/step)")
        p.add_argument("--dtype", default="fp32", help="fp32 | bf16")
        p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
        p.add_argument("--trust-remote-code", action="store_true",
                       help="allow a target whose modelling code ships with its weights (LLaDA, Dream) to run it")
        if name == "trajectories":
            p.add_argument("--out", required=True, help="trajectory folder (resumable)")
            p.add_argument("--shard-size", type=int, default=8, help="prompts per safetensors shard")
            p.add_argument("--full", action="store_true", help="decode all gen-length slots (default: stop after "
                           "the block holding the reference's EoT)")
        else:
            p.add_argument("--filter", default=None, help="Learn2PD export folder (recipe=learn2pd)")
            p.add_argument("--threshold", type=float, default=None, help="override the filter's threshold")
            p.add_argument("--cache", default="off", choices=["off", "on", "both"],
                           help="prefix KV cache across finished blocks: off, on, or every mode both ways")
            p.add_argument("--temperature", type=float, default=0.0)
            p.add_argument("--out", default=None, help="write the result JSON here")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``draftsmith`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if argv and argv[0] == "train":  # everything after `train` is Hydra's
        return _cmd_train(argv[1:])
    if argv and argv[0] == "bench-train":
        return _cmd_bench_train(argv[1:])
    if argv and argv[0] == "cache-features":  # Hydra overrides plus --out/--dtype/--shard-mb
        from draftsmith.train import cache_features_main

        return cache_features_main(argv[1:])
    parser = argparse.ArgumentParser(prog="draftsmith", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="train a drafter: draftsmith train recipe=medusa [hydra overrides]")
    p = sub.add_parser("export", help="export a run folder or checkpoint")
    p.add_argument("source", help="run folder (holding checkpoints/last.ckpt), .ckpt file, or export folder")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--format", default="draftsmith", choices=["draftsmith", "medusa", "speculators"])
    p.add_argument("--target", default=None, help="target folder or alias for converters (default: the target the "
                   "export records); speculators writes its absolute folder path as the verifier")
    sub.add_parser("bench-train", help="training tokens/s vs target forward tokens/s: draftsmith bench-train recipe=medusa")
    sub.add_parser("cache-features", help="run the target once and cache the features a recipe taps: "
                                          "draftsmith cache-features recipe=eagle3 --out DIR")
    sub.add_parser("assets", help="prepare the embedded target, data and prompts; print their counts")
    from draftsmith.runtime import cli as runtime_cli

    runtime_cli.add_subcommands(sub)
    _add_diffusion_subcommands(sub)
    args = parser.parse_args(argv)
    handlers = {"export": _cmd_export, "assets": _cmd_assets, "diffusion-export": _cmd_diffusion_export,
                "trajectories": _cmd_trajectories, "diffusion-bench": _cmd_diffusion_bench, **runtime_cli.HANDLERS}
    try:
        return handlers[args.command](args)
    except Exception as err:  # noqa: BLE001 - one clear line for user errors, full trace with DRAFTSMITH_DEBUG
        import os

        if os.environ.get("DRAFTSMITH_DEBUG"):
            raise
        # An exception without a message (StopIteration, a bare assert) is a bug: name it and how to see where.
        text = str(err) or f"{type(err).__name__} (a bug; rerun with DRAFTSMITH_DEBUG=1 for the traceback)"
        print(f"draftsmith {args.command}: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
