"""The import command: a speculators-format EAGLE-3 checkpoint (what the speculators trainer saves)
into a draftsmith export that ``draftsmith bench/generate --drafter`` serves
(:mod:`draftsmith.export.speculators_import`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from draftsmith.cli.preflight import add_trust_flag
from draftsmith.common.errors import InputError


def target_of(spec_config: dict[str, Any], target: str | None) -> str:
    """The target folder to import against: ``--target`` (alias resolved) or the checkpoint's
    recorded verifier; one line when it is not a local model folder (the sizes, tokenizer and
    embedding are read from it).
    """
    from draftsmith import assets
    from draftsmith.export.folder_kinds import target_problem
    from draftsmith.export.speculators_import import verifier_name

    given = target or verifier_name(spec_config)
    if not given:
        raise InputError(
            "the checkpoint records no verifier (speculators_config.verifier.name_or_path): pass "
            "--target FOLDER"
        )
    folder = Path(assets.resolve_target(str(given))).expanduser()
    if problem := target_problem(
        "--target" if target else "the checkpoint's recorded verifier", str(folder)
    ):
        raise InputError(problem)
    if not (folder / "config.json").is_file():
        where = "--target" if target else "the checkpoint's recorded verifier"
        raise InputError(
            f"{where} {given!r} is not a local model folder (no config.json): pass --target with"
            " the folder of the model the drafter was trained against"
        )
    return str(folder.resolve())


def target_facts(folder: str, trust_remote_code: bool = False) -> tuple[dict[str, Any], Any]:
    """(export identity, input embedding [V, H] or None) of the target folder ``folder``; a folder
    whose own code would run is refused unless ``trust_remote_code``."""
    from transformers import AutoConfig, AutoTokenizer

    from draftsmith.common.remote_code import refuse_remote_code
    from draftsmith.export.identity import target_identity
    from draftsmith.export.verifier import local_embedding
    from draftsmith.runtime.target.weights import load_lm_head

    refuse_remote_code(folder, trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise InputError(
            f"{folder} has no tokenizer ({type(err).__name__}): an export records the target's "
            "tokenizer fingerprint; pass a model folder saved with its tokenizer"
        ) from err
    hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    identity = target_identity(folder, hf_config, tokenizer, load_lm_head(folder))
    return identity, local_embedding(folder)


def _cmd_import(args: argparse.Namespace) -> int:
    from draftsmith.cli.exporting import _check_out
    from draftsmith.export.speculators_import import import_speculators, read_speculators

    _check_out(args.out, args.checkpoint)
    config, _ = read_speculators(args.checkpoint)
    identity, embed = target_facts(target_of(config, args.target), args.trust_remote_code)
    out = import_speculators(args.checkpoint, args.out, identity, embed)
    print(f"wrote {out}")
    return 0


def _import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        help=(
            "speculators eagle3 folder (config.json + model.safetensors), e.g. a "
            "checkpoint folder the speculators trainer saved"
        ),
    )
    p.add_argument(
        "--out",
        required=True,
        help="draftsmith export folder to write (new, or one draftsmith wrote)",
    )
    p.add_argument(
        "--target",
        default=None,
        help=(
            "target folder or alias the drafter serves with (default: the "
            "checkpoint's recorded verifier); its sizes must match the checkpoint's"
        ),
    )
    add_trust_flag(p)


ARGUMENTS = {"import": _import_arguments}
HANDLERS = {"import": _cmd_import}
