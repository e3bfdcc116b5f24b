"""Import a speculators-format EAGLE-3 checkpoint (``config.json`` with ``speculators_model_type:
eagle3`` + ``model.safetensors``, as the speculators 0.9.0 trainer saves it) into a draftsmith
EAGLE-3 export.

The exact inverse of ``export/speculators.py`` (whose docstring maps every field the other way):

* ``transformer_layer_config`` -> ``architecture``: ``hidden_size``, ``intermediate_size``,
  ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``rope_theta``
  (or ``rope_parameters.rope_theta``), ``max_position_embeddings``; ``vocab_size`` (the target
  vocabulary, the length of ``t2d``); ``draft_vocab_size`` as is;
  ``eagle_aux_hidden_state_layer_ids`` -> ``target_layers`` unchanged (both are HF ``hidden_states``
  indices, the input of decoder layer i); a missing list is speculators' default ``[2, n//2, n-3]``
  of the verifier's ``n`` layers.
* ``speculators_config.proposal_methods[0].speculative_tokens`` -> ``inference.depth =
  speculative_tokens - 1`` (the exporter writes ``depth + 1``); the tree width (``total_tokens`` 16,
  ``top_k`` 4), the greedy verifier and the fixed stop policy are the EAGLE-3 recipe's defaults,
  which the speculators format does not carry.
* weights (export/speculators_import_weights.py): ``layers.0.X`` -> ``layer.X``; ``fc.weight``,
  ``norm.weight``, ``lm_head.weight`` as is; ``d2t`` (int64 offsets, target id = ``i + d2t[i]``) and
  ``t2d`` (bool) as is, or, when the checkpoint has none (full draft vocabulary), ``d2t = 0`` and
  ``t2d = True`` everywhere (what draftsmith stores for a full vocabulary). Floating weights are
  stored as float32 (a bf16 checkpoint widens exactly). ``embed_tokens.weight`` (the verifier's
  frozen embedding) is not stored (draftsmith shares the target's); when the checkpoint has one it
  must equal the target's embedding in the checkpoint's dtype, else the checkpoint was trained for
  another target. ``verifier_norm`` / ``verifier_lm_head`` (trainer-only copies of the verifier's)
  are skipped.
* ``target``: the identity of the target the caller loaded (``--target`` or the recorded verifier);
  the checkpoint's sizes must match it: ``target_hidden_size`` = the target's hidden size, the layer
  config's ``vocab_size`` = its vocabulary, every aux id inside its layers.

What draftsmith's EAGLE-3 layer cannot compute is refused in one line naming the speculators trainer
flag that avoids it: ``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output`` (the
trainer's eagle3 defaults turn the first, second and fourth on), more than one draft layer, a Qwen3
draft layer (``q_norm``/``k_norm``), biases, sliding-window draft attention (the trainer's default;
train with ``--full-attention-indices 0``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from draftsmith.common.constants import EAGLE_TREE_PROPOSER, STOP_FIXED
from draftsmith.export.folder_kinds import folder_kind
from draftsmith.export.format import (
    ExportError,
    TargetMismatchError,
    refuse_non_finite,
    write_export,
)
from draftsmith.export.speculators_import_weights import draftsmith_tensors

log = logging.getLogger(__name__)

# The inference block of the EAGLE-3 recipe (conf/recipe/eagle3.yaml) that the speculators format
# does not carry.
RECIPE_TREE = {"total_tokens": 16, "top_k": 4, "verifier": "greedy"}
# Flags draftsmith's plain EAGLE-3 layer cannot honour, with the trainer flag that turns each off.
_UNSUPPORTED_FLAGS = {
    "norm_before_residual": "train with --no-norm-before-residual",
    "norm_before_fc": "train with --no-norm-before-fc",
    "fc_norm": "train without --fc-norm",
    "norm_output": "train with --no-norm-output",
}
_IMPORT_HINTS = {
    "export": ": it is already a draftsmith export; pass it as --drafter",
    "converted": ": pass the draftsmith export it was converted from as --drafter",
    "model": (
        ": pass a model folder as --target, and import the speculators checkpoint trained for it"
    ),
}


def read_speculators(spec_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) of a speculators folder; a missing, non-eagle3 or unreadable one is
    one line."""
    folder = Path(spec_dir)
    config_path, weights = folder / "config.json", folder / "model.safetensors"
    found = folder_kind(folder)
    if found.kind not in ("speculators", "unknown", "file", "missing", "empty"):
        raise ExportError(
            f"{folder} is {found.label}, not a speculators checkpoint: `draftsmith import` reads"
            " the folders the speculators trainer saves (config.json with speculators_model_type,"
            " and model.safetensors)" + _IMPORT_HINTS.get(found.kind, "")
        )
    if not config_path.is_file() or not weights.is_file():
        raise ExportError(
            f"{folder} is not a speculators checkpoint: it needs config.json and model.safetensors "
            "(what the speculators trainer saves in its checkpoint folders)"
        )
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExportError(f"{config_path} is not valid JSON ({err})") from err
    if not isinstance(config, dict) or "speculators_model_type" not in config:
        raise ExportError(
            f"{config_path} has no speculators_model_type: {folder} is not a speculators checkpoint"
            " (the speculators trainer writes speculators_model_type: eagle3)"
        )
    kind = config.get("speculators_model_type")
    if kind != "eagle3":
        raise ExportError(
            f"{folder} is a speculators {kind!r} checkpoint; draftsmith imports eagle3 checkpoints "
            "(its EAGLE-3 runtime); other types have no draftsmith drafter of the same shape"
        )
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as err:
        raise ExportError(f"{weights} is corrupt or truncated ({err})") from err
    refuse_non_finite(state, weights)
    return config, state


def verifier_name(config: dict[str, Any]) -> str | None:
    """The verifier the checkpoint records (``speculators_config.verifier.name_or_path``), or
    None."""
    return ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")


def layer_config(
    config: dict[str, Any], source: str | Path, required: bool = False
) -> dict[str, Any]:
    """config.json's ``transformer_layer_config`` (the draft layer), refused in one line when it is
    not an object."""
    layer = config.get("transformer_layer_config")
    if layer is None and not required:
        return {}
    if not isinstance(layer, dict):
        raise ExportError(
            f"{source}: config.json's transformer_layer_config must be an object (the draft layer's"
            f" config), got {type(layer).__name__}"
        )
    return layer


def check_layer(config: dict[str, Any], source: str | Path) -> dict[str, Any]:
    """The draft layer's config, refused in one line when draftsmith's EAGLE-3 layer cannot compute
    it."""
    layer = layer_config(config, source)
    problems = [
        f"{flag}=true ({fix})" for flag, fix in _UNSUPPORTED_FLAGS.items() if config.get(flag)
    ]
    if int(layer.get("num_hidden_layers", 1)) != 1:
        problems.append(f"{layer['num_hidden_layers']} draft layers (train with --num-layers 1)")
    if layer.get("model_type", "llama") != "llama":
        problems.append(
            f"a {layer.get('model_type')!r} draft layer (train with --draft-arch llama)"
        )
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        problems.append("biases in the draft layer")
    if layer.get("hidden_act", "silu") != "silu":
        problems.append(
            f"hidden_act {layer.get('hidden_act')!r} (draftsmith's layer is SwiGLU: silu)"
        )
    if "sliding_attention" in (layer.get("layer_types") or []):
        problems.append("sliding-window draft attention (train with --full-attention-indices 0)")
    if problems:
        raise ExportError(
            f"{source}: draftsmith's EAGLE-3 layer cannot run this checkpoint: "
            + "; ".join(problems)
        )
    return layer


def _rope_theta(layer: dict[str, Any]) -> float:
    params = layer.get("rope_parameters") or {}
    theta = layer.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise ExportError(
            "the draft layer config has neither rope_theta nor rope_parameters.rope_theta"
        )
    return float(theta)


def architecture_of(
    config: dict[str, Any], num_target_layers: int, source: str | Path = ""
) -> dict[str, Any]:
    """draftsmith's EAGLE-3 ``architecture`` block of a speculators eagle3 config (module
    docstring); a missing or mistyped key is one line naming it."""
    layer = layer_config(config, source, required=True)
    try:
        return _architecture(config, layer, num_target_layers)
    except KeyError as err:
        raise ExportError(f"{source}: config.json's transformer_layer_config lacks {err}") from None
    except (TypeError, ValueError) as err:
        raise ExportError(
            f"{source}: config.json holds a value of the wrong type ({err}): the draft layer's"
            " sizes are integers, its ids a list of integers"
        ) from None


def _architecture(
    config: dict[str, Any], layer: dict[str, Any], num_target_layers: int
) -> dict[str, Any]:
    heads = int(layer["num_attention_heads"])
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if not aux:  # speculators' resolve_target_layer_ids default
        aux = [2, num_target_layers // 2, num_target_layers - 3]
    return {
        "hidden_size": int(layer["hidden_size"]),
        "vocab_size": int(layer["vocab_size"]),
        "intermediate_size": int(layer["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(layer.get("num_key_value_heads") or heads),
        "head_dim": int(layer.get("head_dim") or int(layer["hidden_size"]) // heads),
        "rms_norm_eps": float(layer.get("rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta(layer),
        "max_position_embeddings": int(layer.get("max_position_embeddings", 2048)),
        "draft_vocab_size": int(config.get("draft_vocab_size") or layer["vocab_size"]),
        "target_layers": [int(i) for i in aux],
    }


def check_sizes(
    config: dict[str, Any], arch: dict[str, Any], identity: dict[str, Any], source: str | Path
) -> None:
    """Refuse a checkpoint whose verifier's sizes are not the target's (TargetMismatchError, one
    line)."""
    hidden = int(config.get("target_hidden_size") or arch["hidden_size"])
    n = int(identity["num_hidden_layers"])
    diffs = [
        f"{what}: checkpoint has {ours}, target has {theirs}"
        for what, ours, theirs in (
            ("hidden_size", hidden, int(identity["hidden_size"])),
            ("vocab_size", arch["vocab_size"], int(identity["vocab_size"])),
        )
        if ours != theirs
    ]
    if hidden != arch["hidden_size"]:
        diffs.append(
            f"target_hidden_size {hidden} != draft hidden_size {arch['hidden_size']} (draftsmith's"
            " EAGLE-3 fuses taps of the drafter's own width)"
        )
    bad = [i for i in arch["target_layers"] if not 0 <= i < n]
    if bad:
        diffs.append(f"aux hidden-state ids {bad} outside the target's hidden_states[0..{n - 1}]")
    if diffs:
        raise TargetMismatchError(
            f"{source} was trained for another verifier than the target "
            f"{identity.get('name_or_path')!r}: "
            + "; ".join(diffs)
            + "; pass the target it was trained for with --target"
        )


def inference_of(config: dict[str, Any]) -> dict[str, Any]:
    """The export's ``inference`` block: depth = speculative_tokens - 1, the recipe's tree width
    otherwise."""
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    steps = int(methods[0].get("speculative_tokens") or 5)
    return {
        "proposer": EAGLE_TREE_PROPOSER,
        "total_tokens": RECIPE_TREE["total_tokens"],
        "depth": max(steps - 1, 0),
        "top_k": RECIPE_TREE["top_k"],
        "verifier": RECIPE_TREE["verifier"],
        "stop_policy": {"kind": STOP_FIXED},
    }


def import_speculators(
    spec_dir: str | Path,
    out_dir: str | Path,
    identity: dict[str, Any],
    embed_weight: torch.Tensor | None = None,
) -> Path:
    """Write the draftsmith EAGLE-3 export of the speculators checkpoint ``spec_dir`` into
    ``out_dir`` (atomically).

    ``identity``: the target's export identity (:func:`draftsmith.export.identity.target_identity`),
    the target the drafter will serve with; ``embed_weight`` [V, H]: its input embedding, compared
    with a stored one.
    """
    config, state = read_speculators(spec_dir)
    check_layer(config, spec_dir)
    arch = architecture_of(config, int(identity["num_hidden_layers"]), spec_dir)
    check_sizes(config, arch, identity, spec_dir)
    tensors = draftsmith_tensors(state, arch, spec_dir, embed_weight)
    provenance = {
        "format": "speculators",
        "path": str(Path(spec_dir).resolve()),
        "speculators_version": config.get("speculators_version"),
        "verifier": verifier_name(config),
        "torch_dtype": config.get("torch_dtype") or config.get("dtype"),
    }
    export_config = {
        "method": "eagle3",
        "architecture": arch,
        "target": dict(identity),
        "inference": inference_of(config),
        "training": {"imported_from": provenance},
    }
    out = write_export(out_dir, tensors, export_config)
    log.info("imported speculators eagle3 checkpoint %s into %s", spec_dir, out)
    return out


__all__ = ["architecture_of", "import_speculators", "read_speculators", "verifier_name"]
