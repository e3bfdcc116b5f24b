"""Convert a draftsmith DFlash export into the z-lab layout (``--format dflash-zlab``), and check
and name the drafter body's tensors for vLLM's speculators ``dflash`` type (``--format
speculators``, written by export/speculators_dflash.py); llama.cpp's GGUF (``--format gguf``) is
converted from the z-lab layout by llama.cpp's own converter (``export/gguf.py``).

Tap convention. draftsmith's ``architecture.target_layers`` are indices into the target's HF
``hidden_states`` tuple (0 = the embeddings, ``i`` = the output of decoder layer ``i - 1`` = the
input of decoder layer ``i``), exactly as EAGLE-3's. Each format names the same hidden states
differently:

* z-lab (``dflash_config.target_layer_ids``, z-lab/dflash ``dflash/model.py`` @
  44947fbf71114e241c96de194f4b382b5dd330d0, ``extract_context_feature``: ``hidden_states[layer_id +
  1]``): the decoder layer whose OUTPUT is tapped, so ``target_layer_ids = target_layers - 1``.
  llama.cpp's converter reads the same field (``conversion/qwen.py`` ``DFlashModel``:
  ``extract_layer_ids = [i + 1 ...]``, captured at the input of that layer), so the GGUF taps the
  same states.
* speculators ``dflash`` (``aux_hidden_state_layer_ids``): vLLM's ``update_dflash`` (algos.py, vLLM
  #40727) writes ``dflash_config.target_layer_ids = aux - 1`` and captures
  ``eagle_aux_hidden_state_layer_ids = aux`` at the input of those layers, i.e.
  ``hidden_states[aux]``; speculators' own ``DFlashConverter`` (0.9.0) turns z-lab ids into ``aux =
  target_layer_ids + 1``. So the aux ids are draftsmith's ``target_layers`` unchanged.

A tap at ``hidden_states[0]`` (the embeddings: no layer's output) or at ``hidden_states[n]`` (after
the last layer: HF applies the final norm there, the engines capture layer inputs and have no layer
``n``) has no id in these formats and is refused.

Both layouts hold the same tensors, no embedding and no LM head (the engines share the target's):
``fc.weight`` [H, n_taps * H], ``hidden_norm.weight``,
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``,
``layers.{i}.{input_layernorm,post_attention_layernorm}.weight``, ``norm.weight`` (the draftsmith
names already; key lists checked in tests/test_dflash_export.py). The optional ``confidence_head.*``
(a block cut) and ``markov_head.*`` make the drafter DSpark-shaped: ``--format speculators`` then
writes speculators' ``dspark`` type and ``--format gguf`` a DeepSpec-style folder for llama.cpp's
``draft-dspark`` (export/dspark.py); the z-lab layout has no slot for them and leaves them out
(logged, and listed under ``draftsmith.dropped`` in config.json).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from draftsmith.common.dtypes import dtype_from_name
from draftsmith.export.converters import ConvertRequest, ExportFormat, register_format
from draftsmith.export.format import ExportError, atomic_folder_write, read_export

log = logging.getLogger(__name__)

ZLAB_ARCHITECTURE = "DFlashDraftModel"
OPTIONAL_HEADS = (
    "confidence_head.",
    "markov_head.",
)  # draftsmith-only heads, left out of engine layouts
_LAYER_PARTS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
_DTYPES = ("float32", "bfloat16", "float16")


def dflash_key_names(num_layers: int) -> list[str]:
    """Every tensor name of a DFlash drafter body with ``num_layers`` layers (the same in all
    layouts)."""
    return [
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        *(f"layers.{i}.{p}" for i in range(num_layers) for p in _LAYER_PARTS),
    ]


def _arch_int(arch: dict[str, Any], *names: str) -> int:
    for name in names:
        if arch.get(name) is not None:
            return int(arch[name])
    raise ExportError(
        f"DFlash export architecture lacks {names[0]!r}; re-export with this draftsmith version"
    )


def check_dflash(config: dict[str, Any], source: str | Path) -> None:
    """Refuse what no DFlash layout can hold: another method, a mask token outside the vocabulary, a
    block of one, a tap without an id in the engines' conventions (module docstring)."""
    method = config.get("method")
    if method != "dflash":
        raise ExportError(f"this converter holds DFlash drafters; {source} is a {method!r} export")
    arch = config["architecture"]
    vocab = _arch_int(arch, "vocab_size")
    mask = arch.get("mask_token_id")
    if mask is None or not 0 <= int(mask) < vocab:
        raise ExportError(
            f"{source}: mask_token_id {mask!r} is outside the target vocabulary [0, {vocab}); the "
            "engines embed it with the target's embedding table: retrain with a mask id inside it"
        )
    if _arch_int(arch, "block_size") < 2:
        raise ExportError(
            f"{source}: block_size {arch['block_size']} drafts nothing (a block is the verified"
            " token plus block_size - 1 masks); retrain with block_size >= 2"
        )
    taps = [int(t) for t in arch["target_layers"]]
    n = config.get("target", {}).get("num_hidden_layers")
    bad = [t for t in taps if t < 1 or (n is not None and t >= int(n))]
    if bad:
        raise ExportError(
            f"{source}: taps hidden_states{bad} have no layer id in the z-lab/speculators/llama.cpp"
            f" conventions (they name layer outputs 0..{'n-2' if n is None else int(n) - 2}, i.e."
            " hidden_states[1..n-1]); retrain with taps inside that range"
        )


def zlab_layer_ids(taps: list[int]) -> list[int]:
    """z-lab ``target_layer_ids`` (decoder layer whose output is tapped) of draftsmith taps
    (``hidden_states``)."""
    return [int(t) - 1 for t in taps]


def dflash_tensors(
    state: dict[str, torch.Tensor], num_layers: int
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The drafter body's tensors under their engine names (identical to draftsmith's) and the
    optional heads' names left out; a missing or unknown name is an :class:`ExportError`."""
    names = dflash_key_names(num_layers)
    dropped = sorted(k for k in state if k.startswith(OPTIONAL_HEADS))
    missing = [k for k in names if k not in state]
    unexpected = [k for k in state if k not in names and k not in dropped]
    if missing or unexpected:
        raise ExportError(
            f"DFlash export weights do not match the expected layout (missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}); re-export with this draftsmith version"
        )
    if dropped:
        log.warning(
            "the engine layout has no slot for draftsmith's %s: left out, engines draft with the"
            " plain DFlash forward",
            sorted({k.split(".")[0] for k in dropped}),
        )
    return {k: state[k].detach().to("cpu").contiguous() for k in names}, dropped


def qwen3_layer_config(config: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3 transformer config of the draft layers (z-lab's ``Qwen3Config``, speculators' layer
    config)."""
    arch = config["architecture"]
    layers = _arch_int(arch, "num_layers", "num_hidden_layers")
    theta = float(arch["rope_theta"])
    return {
        "model_type": "qwen3",
        "hidden_size": _arch_int(arch, "hidden_size"),
        "intermediate_size": _arch_int(arch, "intermediate_size"),
        "num_hidden_layers": layers,
        "num_attention_heads": _arch_int(arch, "num_heads", "num_attention_heads"),
        "num_key_value_heads": _arch_int(arch, "num_kv_heads", "num_key_value_heads"),
        "head_dim": _arch_int(arch, "head_dim"),
        "rms_norm_eps": float(arch["rms_norm_eps"]),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": int(arch.get("max_position_embeddings") or 32768),
        "vocab_size": _arch_int(arch, "vocab_size"),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "layer_types": ["full_attention"] * layers,
    }


def conversion_provenance(
    config: dict[str, Any], source: str | Path, dropped: list[str]
) -> dict[str, Any]:
    """The ``draftsmith`` block of a converted config.json: the export converted, its taps as
    ``hidden_states`` indices and the optional heads left out."""
    return {
        "converted_from": str(source),
        "target_layers_hidden_states": list(config["architecture"]["target_layers"]),
        "dropped": sorted({k.split(".")[0] for k in dropped}),
    }


def zlab_config(
    config: dict[str, Any], dtype: str, source: str | Path = "", dropped: list[str] = ()
) -> dict:
    """The z-lab ``config.json`` (``DFlashDraftModel``) of a draftsmith DFlash export config."""
    arch = config["architecture"]
    block = int(arch["block_size"])
    return {
        "architectures": [ZLAB_ARCHITECTURE],
        **qwen3_layer_config(config),
        "is_causal": False,
        "block_size": block,
        "num_target_layers": int(config["target"]["num_hidden_layers"]),
        "dflash_config": {
            "block_size": block,
            "mask_token_id": int(arch["mask_token_id"]),
            "target_layer_ids": zlab_layer_ids(arch["target_layers"]),
        },
        "torch_dtype": dtype,
        "dtype": dtype,
        "draftsmith": conversion_provenance(config, source, list(dropped)),
    }


def converted_dflash(
    export_dir: str | Path, source: str | Path | None, dtype: str | None, same_hidden: str | None
):
    """(config, tensors, dropped, dtype name) of a DFlash export, checked; ``same_hidden`` names the
    layout that needs the target's hidden size to equal the drafter's."""
    config, state = read_export(export_dir)
    src = source or export_dir
    check_dflash(config, src)
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; valid: {', '.join(_DTYPES)}")
    arch = config["architecture"]
    h, th = _arch_int(arch, "hidden_size"), _arch_int(arch, "target_hidden_size", "hidden_size")
    if same_hidden and h != th:
        raise ExportError(
            f"{src}: {same_hidden} sizes fc by the drafter's hidden size ({h}), but the target's is"
            f" {th}; use --format speculators (it records target_hidden_size)"
        )
    tensors, dropped = dflash_tensors(state, _arch_int(arch, "num_layers", "num_hidden_layers"))
    if dtype is not None:
        tensors = {k: v.to(dtype_from_name(dtype)) for k, v in tensors.items()}
    return config, tensors, dropped, str(tensors["fc.weight"].dtype).removeprefix("torch.")


def write_zlab(
    export_dir: str | Path,
    out_dir: Path,
    source: str | Path | None = None,
    dtype: str | None = None,
) -> dict[str, Any]:
    """Write the z-lab layout of ``export_dir`` into the existing folder ``out_dir`` (not atomic:
    the caller's temporary folder); returns the draftsmith export config."""
    config, tensors, dropped, written = converted_dflash(
        export_dir, source, dtype, "the z-lab layout"
    )
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    out = zlab_config(config, written, Path(source or export_dir).resolve(), dropped)
    (out_dir / "config.json").write_text(json.dumps(out, indent=2) + "\n")
    return config


def to_zlab(
    export_dir: str | Path,
    out_dir: str | Path,
    source: str | Path | None = None,
    dtype: str | None = None,
) -> Path:
    """Write the z-lab layout (``config.json`` + ``model.safetensors``) of a DFlash export into
    ``out_dir``, atomically; load it with z-lab's ``DFlashDraftModel.from_pretrained(out_dir)``."""
    out = atomic_folder_write(
        out_dir,
        lambda tmp: write_zlab(export_dir, tmp, source, dtype),
        sources=(export_dir, source),
    )
    log.info("wrote z-lab DFlash folder %s", out)
    return out


def _convert_request(request: ConvertRequest) -> Path:
    return to_zlab(request.export_dir, request.out, source=request.source)


register_format(
    ExportFormat(
        "dflash-zlab", ("dflash",), _convert_request, help="z-lab's DFlashDraftModel layout"
    )
)
