"""Engine commands: engine-check (run an EAGLE-3 or DFlash export inside llama.cpp and compare it
with the runtime)."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from draftsmith.cli.arguments import COUNT, counts, served_dtype
from draftsmith.cli.preflight import add_trust_flag
from draftsmith.common.errors import InputError


def _gguf_files(export: str, gguf_dir: str | None, tmp: str) -> dict[str, str]:
    """The target and draft GGUF files of ``export``: ``gguf_dir``'s when it holds a conversion,
    else converted into ``gguf_dir`` (or the temporary ``tmp``) with ``draftsmith export --format
    gguf``'s converter."""
    from draftsmith.cli.exporting import _convert
    from draftsmith.export.format import CONFIG_FILE, read_config
    from draftsmith.export.gguf import MANIFEST, read_manifest

    folder = Path(gguf_dir) if gguf_dir else Path(tmp) / "gguf"
    if not (folder / MANIFEST).is_file():
        if not (Path(export) / CONFIG_FILE).is_file():
            raise InputError(
                f"{export} is not a draftsmith export folder (no {CONFIG_FILE}); export the run"
                " first"
            )
        _convert(export, folder, "gguf", read_config(export), None, source=export)
    return read_manifest(folder)["paths"]


def _check_inputs(args: argparse.Namespace) -> None:
    """Refuse, before any conversion: an export llama.cpp cannot run (named as what it is), a target
    whose own code would run, and a ``--out`` the write rule refuses (never the export, never a file
    of the user's).
    """
    from draftsmith.cli.preflight import refuse_bad_exports
    from draftsmith.common.atomic_folder import check_folder_target, check_output_file
    from draftsmith.evals.engine_check import LABELS
    from draftsmith.export.folder_kinds import drafter_problem
    from draftsmith.export.format import EXPORT_OUTPUT, read_config
    from draftsmith.export.gguf import MANIFEST

    if problem := drafter_problem("", args.export):
        raise InputError(problem)
    method = read_config(args.export).get("method")
    if method not in LABELS:
        raise InputError(
            f"{args.export} is a {method!r} export; engine-check runs {', '.join(LABELS.values())} "
            "drafters in llama.cpp (its speculative tool has no other drafter)"
        )
    refuse_bad_exports(
        argparse.Namespace(drafter=args.export, trust_remote_code=args.trust_remote_code)
    )
    # converted there: never into the user's folder
    if args.gguf and not (Path(args.gguf) / MANIFEST).is_file():
        check_folder_target(args.gguf, EXPORT_OUTPUT, sources=(args.export,), flag="--gguf")
    if args.out:
        check_output_file(args.out, (args.export, args.gguf), owned=_is_result)


def _is_result(path: Path) -> bool:
    """An engine-check result JSON (what a previous run wrote), which a new run may replace."""
    try:
        return {"llamacpp", "runtime"} <= set(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return False


def _cmd_engine_check(args: argparse.Namespace) -> int:
    from draftsmith.evals.engine_check import engine_check
    from draftsmith.evals.engine_check_report import markdown

    if args.engine != "llamacpp":
        raise InputError(f"--engine {args.engine!r}; valid: llamacpp")
    _check_inputs(args)
    with tempfile.TemporaryDirectory(prefix="draftsmith-engine-check-") as tmp:
        paths = _gguf_files(args.export, args.gguf, tmp)
        result = engine_check(
            args.export,
            paths["target"],
            paths["draft"],
            args.prompts,
            args.num_prompts,
            args.max_new_tokens,
            args.draft_n_max,
            args.threads,
            args.dtype,
        )
    if args.gguf is None:  # the temporary files are gone
        result["target_gguf"] = result["draft_gguf"] = "(temporary)"
    if args.out:
        from draftsmith.common.atomic_folder import write_file

        write_file(args.out, json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    return 0


def _engine_check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("export", help="draftsmith export folder (EAGLE-3 or DFlash)")
    p.add_argument("--engine", default="llamacpp", choices=("llamacpp",))
    p.add_argument(
        "--gguf",
        default=None,
        help=(
            "folder of `draftsmith export --format gguf` (converted there when "
            "empty; default: a temporary conversion)"
        ),
    )
    p.add_argument("--prompts", default="mtbench", help="mtbench | humaneval | FILE.jsonl")
    p.add_argument("--num-prompts", type=COUNT, default=2)
    p.add_argument("--max-new-tokens", type=COUNT, default=32)
    p.add_argument(
        "--draft-n-max",
        type=counts("tokens drafted per step"),
        default=None,
        help=(
            "tokens drafted per step: llama.cpp's --spec-draft-n-max and the runtime's chain length"
            " (default: 4; DFlash: block_size - 1, the trained block: llama.cpp's DFlash block is"
            " n_max + 1 tokens)"
        ),
    )
    p.add_argument("--threads", type=COUNT, default=2)
    p.add_argument(
        "--dtype",
        default="auto",
        type=served_dtype,
        help="the draftsmith runtime's dtype (auto | bf16 | fp32)",
    )
    p.add_argument(
        "--out", default=None, help="write the result JSON here (a new file, or an earlier result)"
    )
    add_trust_flag(p)


def _engine_check_kept(args: argparse.Namespace) -> str:
    """What an interrupted ``engine-check`` kept: a conversion into ``--gguf`` (reused by the next
    run)."""
    from draftsmith.export.gguf import MANIFEST

    if args.gguf and (Path(args.gguf) / MANIFEST).is_file():
        return (
            f"kept the GGUF conversion in {args.gguf} (the next run reuses it); no result was"
            " written"
        )
    return "nothing was written (the result is written at the end)"


KEPT = {"engine-check": _engine_check_kept}
ARGUMENTS = {"engine-check": _engine_check_arguments}
HANDLERS = {"engine-check": _cmd_engine_check}
