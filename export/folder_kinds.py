"""What a folder a user passed is, read from its files alone (nothing is loaded), so a refusal can
name it and the command that makes it usable: a draftsmith export, a layout converted for another
engine, a speculators checkpoint, a GGUF conversion, a training run folder, a model folder, a
block-diffusion model folder."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.common.diffusion_format import DIFFUSION_KEY

# Files from which transformers builds a tokenizer (fast, sentencepiece, BPE, WordPiece): a model
# folder needs one.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
    "vocab.txt",
    "tekken.json",
)


@dataclass(frozen=True)
class FolderKind:
    """``kind`` (export | converted | speculators | medusa-layout | gguf | run | model |
    diffusion-model | file | missing | empty | unknown), ``label`` (what a message calls it) and
    ``config`` (its config.json, or {}).
    """

    kind: str
    label: str
    config: dict[str, Any]


def _config(folder: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else {"<not an object>": raw}


def folder_kind(path: str | Path) -> FolderKind:
    """What ``path`` is (module docstring)."""
    folder = Path(path).expanduser()
    if not folder.exists():
        return FolderKind("missing", "a path that does not exist", {})
    if not folder.is_dir():
        return FolderKind("file", "a file, not a folder", {})
    if (folder / "gguf.json").is_file():
        return FolderKind("gguf", "a GGUF conversion (for llama.cpp)", {})
    config = _config(folder)
    if config is None:
        if (folder / "checkpoints").is_dir() or (folder / "export" / "config.json").is_file():
            return FolderKind("run", "a training run folder", {})
        empty = not any(folder.iterdir())
        return FolderKind(
            "empty" if empty else "unknown",
            "an empty folder" if empty else "a folder with no config.json",
            {},
        )
    if "<not an object>" in config:
        return FolderKind("unknown", "a folder whose config.json is not a JSON object", {})
    if config.get("format") == "draftsmith" or ("method" in config and "architecture" in config):
        return FolderKind("export", f"a draftsmith {config.get('method')!r} export", config)
    if config.get("speculators_model_type") is not None or "speculators_config" in config:
        return FolderKind(
            "speculators",
            f"a speculators {config.get('speculators_model_type')!r} checkpoint (the "
            "vLLM speculators format)",
            config,
        )
    block = config.get("draftsmith")
    if isinstance(block, dict):
        layout = str(config.get("model_type") or "engine")
        return FolderKind(
            "converted",
            f"a draftsmith export converted to the {layout} layout for another engine "
            f"(from {block.get('converted_from', '?')})",
            config,
        )
    if str(config.get("model_type", "")).lower() == "medusa" or "medusa_num_heads" in config:
        return FolderKind("medusa-layout", "a Medusa checkpoint in the vLLM/TGI layout", config)
    if DIFFUSION_KEY in config:
        return FolderKind("diffusion-model", "a block-diffusion model folder", config)
    if "model_type" in config or "architectures" in config:
        kind = config.get("model_type") or (config.get("architectures") or ["?"])[0]
        return FolderKind("model", f"a target model folder ({kind})", config)
    return FolderKind(
        "unknown", "a folder whose config.json is neither a model's nor an export's", config
    )


def drafter_problem(flag: str, given: str) -> str | None:
    """Why ``given`` cannot be the draftsmith export ``flag`` (``--drafter``, ``--controller``; ""
    for a positional argument) asks for, with the command that makes one; None for an export (or a
    path the loader names itself).
    """
    found = folder_kind(given)
    source = (found.config.get("draftsmith") or {}).get("converted_from", "?")
    if found.kind == "file":
        hint = f" ({Path(given).parent})" if Path(given).name == "config.json" else ""
        where = f"{flag} {given}".strip()
        return (
            f"{where} is a file, not an export folder: pass the folder that holds config.json{hint}"
        )
    fixes = {
        "model": (
            f"pass it as --target {given}, and {flag} the export a training run wrote (<run"
            " dir>/export, or `draftsmith export RUN --out DIR`)"
        ),
        "speculators": (
            f"import it first: `draftsmith import {given} --out DIR`, then pass {flag} DIR"
        ),
        "converted": f"pass the draftsmith export it was converted from ({source})",
        "medusa-layout": (
            "draftsmith serves its own exports and does not import this layout: train one with "
            "`python train.py recipe=medusa target=...`"
        ),
        "gguf": "pass the draftsmith export it was converted from (gguf.json names it)",
        "run": (
            f"pass its export ({Path(given) / 'export'}), or `draftsmith export {given} --out DIR`"
        ),
        "diffusion-model": f"pass it as --target {given} (bench diffusion, trajectories)",
    }
    if found.kind not in fixes:
        return None
    return (
        f"{flag} {given}".strip()
        + f" is {found.label}, not a draftsmith drafter export: {fixes[found.kind]}"
    )


def target_problem(flag: str, given: str) -> str | None:
    """Why ``given`` cannot be the target model ``flag`` (``--target``) names: an export, a
    converted layout, a run folder...; None for a model folder (or a path the loader names
    itself)."""
    found = folder_kind(given)
    config = found.config
    if found.kind in ("missing", "empty", "file"):
        return (
            f"{flag} {given} is {found.label}: pass a local model folder (config.json, tokenizer,"
            " *.safetensors); draftsmith never downloads a model"
        )
    if found.kind == "export" and config.get("method") == "diffusion_adapt":
        return None  # a block-diffusion export is a target (bench diffusion, trajectories)
    if found.kind == "export":
        recorded = (
            (config.get("target") or {}).get("name_or_path")
            if isinstance(config.get("target"), dict)
            else None
        )
        return (
            f"{flag} {given} is {found.label} (a drafter), not a target model: pass it as --drafter"
            f" {given}, and {flag} the model it was trained for"
            + (f" ({recorded})" if recorded else "")
        )
    if found.kind in ("converted", "speculators", "medusa-layout", "gguf"):
        return (
            f"{flag} {given} is {found.label}, not a target model: pass {flag} the model folder it"
            " drafts for"
        )
    if found.kind == "run":
        return (
            f"{flag} {given} is {found.label}, not a target model: pass {flag} the model folder it"
            " trained against"
        )
    if found.kind == "model" and not any(
        (Path(given) / name).is_file() for name in TOKENIZER_FILES
    ):
        return (
            f"{flag} {given} is a model folder without a tokenizer (none of"
            f" {', '.join(TOKENIZER_FILES[:3])}): save the model with its tokenizer"
            " (tokenizer.save_pretrained(folder)), or pass the folder that has it"
        )
    return None


__all__ = ["FolderKind", "drafter_problem", "folder_kind", "target_problem"]
