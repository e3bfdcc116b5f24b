"""The export command: a run folder or checkpoint -> a draftsmith export, or an export -> an
engine's layout (the converters of :mod:`draftsmith.export.converters`); also the conversion
``engine-check`` and ``bench --engine-parity`` run (``_convert``) and the ``--out`` check ``import``
shares (``_check_out``)."""

from __future__ import annotations

import argparse

from draftsmith.cli.preflight import add_trust_flag
from draftsmith.common.errors import InputError


def _cmd_export(args: argparse.Namespace) -> int:
    """``draftsmith export SOURCE --out DIR [--format F]``: a run folder or checkpoint -> a
    draftsmith export, or (any other format) -> that format's layout. ``--out`` is checked before
    any work: never the user's folder, never the source (:mod:`draftsmith.common.atomic_folder`); a
    run folder is exported into a temporary beside ``--out``.
    """
    from pathlib import Path

    from draftsmith.common.atomic_folder import scratch_folder
    from draftsmith.distill.engine.exporting import export_from_checkpoint
    from draftsmith.export.format import CONFIG_FILE, read_config

    src, is_export = args.source, (Path(args.source) / CONFIG_FILE).is_file()
    _check_out(args.out, src)
    options = {name: getattr(args, name) for name in _format_option_names()}
    if args.format == "draftsmith":
        if is_export:
            raise InputError(
                f"{src} is already a draftsmith export; export takes a run folder or .ckpt file, or"
                " converts an export with --format medusa|speculators|..."
            )
        out = export_from_checkpoint(src, args.out)
    elif is_export:
        out = _convert(
            src,
            args.out,
            args.format,
            read_config(src),
            args.target,
            source=src,
            trust_remote_code=args.trust_remote_code,
            **options,
        )
    # a run folder or checkpoint: exported into a temporary folder beside --out, removed whatever
    # happens
    else:
        with scratch_folder(args.out) as tmp:
            export_dir = export_from_checkpoint(src, tmp / "export")
            out = _convert(
                export_dir,
                args.out,
                args.format,
                read_config(export_dir),
                args.target,
                source=src,
                trust_remote_code=args.trust_remote_code,
                **options,
            )
    print(f"wrote {out}")
    return 0


def _check_out(out: str, source: str) -> None:
    """Refuse, before any work, an ``--out`` that is the source or a folder draftsmith did not
    write."""
    from draftsmith.common.atomic_folder import OutputRefused, check_folder_target
    from draftsmith.export.format import EXPORT_OUTPUT, ExportRefusedError

    try:
        check_folder_target(out, EXPORT_OUTPUT, sources=(source,))
    except OutputRefused as err:
        raise ExportRefusedError(str(err)) from None


def _format_option_names() -> list[str]:
    """The argparse dests the formats' own flags add (gguf's ``quantize``), read from the
    converters."""
    import argparse

    from draftsmith.export.converters import converters

    probe = argparse.ArgumentParser(add_help=False)
    for fmt in converters().values():
        if fmt.add_arguments is not None:
            fmt.add_arguments(probe)
    return [action.dest for action in probe._actions]


def _verifier_folder(config: dict, target: str | None, trust_remote_code: bool = False) -> str:
    """The target a converted export names: ``--target`` or the export's record, aliases resolved to
    their folder.

    A local folder is written as its absolute path (what vLLM/speculators can load); anything else
    (a hub id) as is. A local folder is checked against the export's recorded identity, so a
    converted drafter never names a verifier it was not trained for.
    """
    from pathlib import Path

    from draftsmith import assets

    given = target or str(config["target"]["name_or_path"])
    folder = Path(assets.resolve_target(given)).expanduser()
    if not folder.is_dir():
        return given
    from transformers import AutoConfig, AutoTokenizer

    from draftsmith.common.remote_code import refuse_remote_code
    from draftsmith.export.identity import decoder_identity, target_identity
    from draftsmith.export.target_check import check_target
    from draftsmith.runtime.target.weights import load_lm_head

    refuse_remote_code(folder, trust_remote_code)
    lm_head = load_lm_head(folder)
    trust = {"trust_remote_code": trust_remote_code}
    try:
        identity = target_identity(
            given,
            AutoConfig.from_pretrained(folder, **trust),
            AutoTokenizer.from_pretrained(folder, **trust),
            lm_head,
        )
    except (
        OSError,
        ValueError,
    ):  # a weights-only folder (no tokenizer): check what the weights show
        from draftsmith.runtime.target.weights import load_hf_config

        hf = load_hf_config(folder)
        identity = decoder_identity(
            given, hf.get("hidden_size"), hf.get("num_hidden_layers"), lm_head
        )
    check_target(config, identity, given=given)
    return str(folder.resolve())


def _refuse_format(fmt: str, method: str | None, source: str) -> None:
    """One line when ``fmt`` does not hold ``method``'s exports, naming the formats that do (the
    converters say)."""
    from draftsmith.export.converters import formats_for, get_format
    from draftsmith.recipes import RECIPES

    holder = get_format(fmt)
    if method is None or holder.holds(method):
        return
    entry = RECIPES.get(method)
    # the recipe's declared formats first (the ones it is known by), then any converter it lacks
    listed = dict.fromkeys([*(entry.formats if entry else ()), *formats_for(method)])
    raise InputError(
        f"{source}: --format {fmt} does not hold {method!r} exports{holder.refusal_hint}; "
        f"{entry.label if entry else method} exports as: {', '.join(listed)}"
    )


class _CliHost:
    """What converters ask of the command line
    (:class:`draftsmith.export.converters.ConverterHost`)."""

    def __init__(self, trust_remote_code: bool = False) -> None:
        self.trust_remote_code = trust_remote_code

    def verifier_folder(self, config: dict, target: str | None) -> str:
        return _verifier_folder(config, target, self.trust_remote_code)

    def lm_head(self, folder: str):
        from draftsmith.runtime.target.weights import load_lm_head

        return load_lm_head(folder)

    def llamacpp(self, target_folder: str):
        from draftsmith.bench import llamacpp_build

        reason = llamacpp_build.missing_build_reason()
        if reason:
            raise InputError(f"--format gguf runs llama.cpp's own converter, which is {reason}")
        return llamacpp_build.llamacpp_dir(), llamacpp_build.bf16_gguf(target_folder)


def _to_gguf(export_dir, out, target_folder: str, quant: str | None, source: str):
    """``--format gguf`` without the format check: the cached llama.cpp build converts drafter and
    target."""
    from draftsmith.export.gguf import to_gguf

    root, target_gguf = _CliHost().llamacpp(target_folder)
    return to_gguf(export_dir, out, target_folder, root, target_gguf, quant=quant, source=source)


def _convert(
    export_dir,
    out,
    fmt: str,
    config: dict,
    target: str | None,
    source: str | None = None,
    trust_remote_code: bool = False,
    **options,
):
    """Convert ``export_dir`` to ``fmt`` through the converter that declares it
    (:mod:`draftsmith.export.converters`); errors and the converted folder name ``source`` (what the
    user passed); ``options``: the format's own flags.
    """
    from pathlib import Path

    from draftsmith.export.converters import ConvertRequest, get_format

    source = str(source or export_dir)
    _refuse_format(fmt, config.get("method"), source)
    request = ConvertRequest(
        Path(export_dir), Path(out), config, source, target, _CliHost(trust_remote_code), options
    )
    return get_format(fmt).convert(request)


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source", help="run folder (holding checkpoints/last.ckpt), .ckpt file, or export folder"
    )
    p.add_argument(
        "--out",
        required=True,
        help="output folder (new, or one draftsmith wrote; never the source)",
    )
    from draftsmith.export.converters import converters, export_formats

    formats = converters()
    p.add_argument(
        "--format",
        default="draftsmith",
        choices=export_formats(),
        help="draftsmith (the export) or: "
        + "; ".join(f"{name}: {fmt.help}" for name, fmt in formats.items()),
    )
    p.add_argument(
        "--target",
        default=None,
        help=(
            "target folder or alias for converters (default: the target the "
            "export records); speculators writes its absolute folder path as the verifier"
        ),
    )
    for fmt in formats.values():  # flags a format declares for itself (gguf: --quantize)
        if fmt.add_arguments is not None:
            fmt.add_arguments(p)
    add_trust_flag(p)


ARGUMENTS = {"export": _export_arguments}
HANDLERS = {"export": _cmd_export}
