"""Whether loading a model folder would run Python code shipped inside it, read from its JSON files
alone (nothing is imported), so a command refuses in one line before transformers would ask on stdin
or run it.

transformers runs a folder's own code when ``config.json`` maps an auto class to a module of the
folder (``auto_map``) for a ``model_type`` it does not know, or ``tokenizer_config.json`` does so
for a tokenizer class it does not know. With ``trust_remote_code`` left unset it asks "Do you wish
to run the custom code? [y/N]" on stdin (a ``y`` piped in runs it); draftsmith never leaves it unset
and runs such code only on the user's explicit opt-in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith.common.errors import RemoteCodeRefused


def _json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _known_model_type(model_type: Any) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def _known_tokenizer(name: Any) -> bool:
    import transformers

    return isinstance(name, str) and (
        hasattr(transformers, name) or hasattr(transformers, name.removesuffix("Fast"))
    )


def remote_code_files(folder: str | Path) -> list[str]:
    """The ``file: auto_map`` entries through which loading ``folder`` would run its own code
    (empty: none)."""
    path = Path(folder)
    if not path.is_dir():
        return []
    found = []
    config = _json(path / "config.json")
    if config.get("auto_map") and not _known_model_type(config.get("model_type")):
        found.append(f"config.json auto_map {sorted(config['auto_map'])}")
    tokenizer = _json(path / "tokenizer_config.json")
    if tokenizer.get("auto_map") and not _known_tokenizer(tokenizer.get("tokenizer_class")):
        found.append("tokenizer_config.json auto_map")
    return found


def refuse_remote_code(
    folder: str | Path, allowed: bool, opt_in: str = "--trust-remote-code"
) -> None:
    """Raise :class:`RemoteCodeRefused` (one line naming the folder, what would run and ``opt_in``)
    when loading ``folder`` would run its own code and ``allowed`` is False."""
    if allowed:
        return
    found = remote_code_files(folder)
    if found:
        raise RemoteCodeRefused(
            f"{folder} ships its own Python code ({'; '.join(found)}; a model type transformers "
            "does not know) that loading it would run: draftsmith runs a model folder's code only "
            f"when you pass {opt_in} (read the folder's .py files first)"
        )


__all__ = ["refuse_remote_code", "remote_code_files"]
