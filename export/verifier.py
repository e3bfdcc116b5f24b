"""The verifier an engine layout names (the target vLLM, speculators or llama.cpp loads beside the
drafter): its ``architectures`` and its input embedding, read from a local HF folder when it is one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftsmith.export.format import ExportError

# The verifier's HF class by target model type, for a verifier that is not a local folder.
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def local_embedding(verifier_name_or_path: str) -> torch.Tensor | None:
    """The input embedding [V, H] of a local HF checkpoint folder (None if not a local safetensors
    folder)."""
    from safetensors import safe_open

    folder = Path(verifier_name_or_path).expanduser()
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = {name: folder / weight_map[name] for name in weight_map}
    elif (folder / "model.safetensors").is_file():
        files = None
    else:
        return None
    for name in (
        "model.embed_tokens.weight",
        "embed_tokens.weight",
        "model.language_model.embed_tokens.weight",
    ):
        path = files.get(name) if files is not None else folder / "model.safetensors"
        if path is None:
            continue
        with safe_open(str(path), framework="pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)
    return None


def verifier_architectures(verifier_name_or_path: str, model_type: str) -> list[str]:
    """``architectures`` of the verifier: from its local config.json, else from the recorded model
    type."""
    local = Path(verifier_name_or_path).expanduser() / "config.json"
    if local.is_file():
        archs = json.loads(local.read_text()).get("architectures")
        if archs:
            return list(archs)
    if model_type not in _ARCHITECTURES:
        raise ExportError(
            f"cannot tell the verifier's architecture: {verifier_name_or_path} is not a local "
            f"folder and target model_type {model_type!r} is not one of {sorted(_ARCHITECTURES)}; "
            "pass verifier_architectures explicitly"
        )
    return [_ARCHITECTURES[model_type]]
