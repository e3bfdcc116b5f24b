"""Find and read the weights of a Hugging Face model folder (config.json + safetensors), without
transformers.

Supported layouts: a single ``model.safetensors``, a sharded ``model.safetensors.index.json`` with
its shards, or any ``*.safetensors`` files in the folder. PyTorch pickles (``pytorch_model.bin``)
are refused on purpose: loading them executes pickle code; re-save such a model with
``save_pretrained(folder)`` (safetensors is the default).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from draftsmith.common.errors import DraftsmithError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class WeightsError(DraftsmithError, ValueError):
    """A model folder is missing, incomplete or unreadable; the message says what to fix."""


def _folder(folder: str | Path) -> Path:
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise WeightsError(
            f"model folder {str(path)!r} does not exist or is not a directory; pass a local Hugging"
            " Face model folder (config.json + *.safetensors), e.g. one written by save_pretrained"
        )
    return path


def load_hf_config(folder: str | Path) -> dict:
    """Return the parsed ``config.json`` of a model folder (raises WeightsError when missing or not
    JSON)."""
    path = _folder(folder) / "config.json"
    if not path.is_file():
        raise WeightsError(
            f"{str(path)!r} is missing: the model folder needs the config.json written by "
            "save_pretrained"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise WeightsError(
            f"{path} is not valid JSON (line {err.lineno}: {err.msg}): re-download or re-save the "
            "target (save_pretrained)"
        ) from err


class RemoteCodeRefused(WeightsError):
    """A model folder ships its own Python code and the user did not opt in to running it."""


def check_custom_code(folder: str | Path, trust_remote_code: bool = False) -> bool:
    """Whether loading the folder's model runs its own code (its ``config.json`` ``auto_map`` names
    classes and transformers has no built-in class for its ``model_type``). Without
    ``trust_remote_code`` such a folder is refused here in one line, before transformers would ask
    on stdin or print its own advice; a folder whose ``model_type`` transformers knows loads with
    transformers' own code (its ``auto_map`` is ignored)."""
    config = load_hf_config(folder)
    if not config.get("auto_map"):
        return False
    from transformers import CONFIG_MAPPING

    if config.get("model_type") in CONFIG_MAPPING:
        return False
    if not trust_remote_code:
        raise RemoteCodeRefused(
            f"{folder} holds its own model code (config.json auto_map, model_type "
            f"{config.get('model_type')!r} unknown to transformers); running it is off by default: "
            "pass --trust-remote-code if you trust that code"
        )
    return True


def find_safetensors(folder: str | Path) -> list[Path]:
    """Return the safetensors files holding the model's weights, in a stable order.

    Prefers the shard index, then ``model.safetensors``, then every ``*.safetensors`` in the folder.
    """
    path = _folder(folder)
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise WeightsError(
                f"{str(index)!r} is not a valid shard index (needs a 'weight_map'): {err}"
            ) from err
        shards = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(s.name) for s in shards if not s.is_file()]
        if missing:
            raise WeightsError(
                f"shards listed in {INDEX_NAME} are missing from {str(path)!r}:"
                f" {', '.join(missing)}"
            )
        return shards
    if (path / SINGLE_NAME).is_file():
        return [path / SINGLE_NAME]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    hint = ""
    if any(path.glob("*.bin")) or any(path.glob("*.gguf")):
        hint = (
            " (found .bin/.gguf files: load the model with transformers and re-save it with"
            " save_pretrained(folder))"
        )
    raise WeightsError(f"no safetensors weights in {str(path)!r}{hint}")


def load_safetensors(
    folder: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    keys: Iterable[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Load the folder's tensors into a dict (HF key names), optionally cast to ``dtype`` and
    restricted to ``keys``.

    Floating-point tensors are cast to ``dtype``; integer tensors keep theirs. Raises WeightsError
    when a requested key is absent.
    """
    wanted = set(keys) if keys is not None else None
    out: dict[str, torch.Tensor] = {}
    for file in find_safetensors(folder):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    if wanted is not None and name not in wanted:
                        continue
                    tensor = handle.get_tensor(name)
                    if dtype is not None and tensor.is_floating_point():
                        tensor = tensor.to(dtype)
                    out[name] = tensor.to(device)
        except (OSError, SafetensorError) as err:  # truncated/corrupt files
            raise WeightsError(
                f"{file} is truncated or corrupt ({err}): re-download or re-save the target "
                "(save_pretrained)"
            ) from err
    if wanted is not None and wanted - out.keys():
        raise WeightsError(
            f"tensors missing from {str(folder)!r}: {', '.join(sorted(wanted - out.keys())[:8])}"
        )
    return out


def load_lm_head(folder: str | Path) -> torch.Tensor:
    """The target's LM head [V, H] in fp32 (the embedding when the model ties them)."""
    from draftsmith import assets

    folder = assets.resolve_target(str(folder))
    config = load_hf_config(folder)
    key = "lm_head.weight"
    if config.get("tie_word_embeddings", False):
        key = "model.embed_tokens.weight"
    tensors = load_safetensors(folder, dtype=torch.float32, keys=[key])
    if key not in tensors:
        raise WeightsError(f"{folder} has no {key}")
    return tensors[key]
