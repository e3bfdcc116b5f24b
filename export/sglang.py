"""Convert a draftsmith EAGLE-3 export into SGLang's (and SpecForge's) ``LlamaForCausalLMEagle3``
layout.

Serve with ``python -m sglang.launch_server --model TARGET --speculative-algorithm EAGLE3
--speculative-draft-model-path OUT``. What SGLang's ``python/sglang/srt/models/llama_eagle3.py``
reads (key list checked in tests/test_sglang_layout.py):

config.json (a Llama config of the one draft layer): ``architectures: ["LlamaForCausalLMEagle3"]``,
``model_type: llama``, ``num_hidden_layers: 1``, ``vocab_size`` (the target's), ``draft_vocab_size``
(always set: a null one would make SGLang take the target's LM head instead of ours),
``target_hidden_size``, the layer's sizes (``hidden_size``, ``intermediate_size``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``rope_theta``,
``max_position_embeddings``), ``tie_word_embeddings: false``, ``hidden_act: silu`` and
``eagle_config.eagle_aux_hidden_state_layer_ids``. SGLang captures the target's hidden state at the
input of layer ``id + 1`` (``set_eagle3_layers_to_capture``: ``[val + 1 for val in layer_ids]``),
i.e. HF ``hidden_states[id + 1]``, while draftsmith's ``architecture.target_layers`` are HF
``hidden_states`` indices: written as ``target_layers - 1`` (vLLM's speculators ids have no such
offset). A tap at ``hidden_states[0]`` (the embeddings) has no SGLang id and is refused.

model.safetensors (no ``model.`` prefix; SGLang adds it): ``fc.weight`` [H, 3H];
``midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v,o}_proj.weight`` (q/k/v over 2H),
``midlayer.mlp.{gate,up,down}_proj.weight`` (SGLang fuses q/k/v and gate/up while loading);
``norm.weight``; ``lm_head.weight`` [draft_vocab, H]; ``d2t`` int64 [draft_vocab] with target id =
``i + d2t[i]`` (SGLang's hot token ids; written for a full vocabulary too, all zeros, as older
SGLang reads it unconditionally); ``t2d`` (bool, skipped by SGLang, kept for other readers). No
``embed_tokens.weight``: SGLang replaces the draft embedding with the target's (``set_embed``).
SGLang drops unknown names silently, so ``layers.0.*`` (the speculators names) would load
nothing: hence the separate format.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from draftsmith.export.converters import ConvertRequest, ExportFormat, register_format
from draftsmith.export.format import ExportError, atomic_folder_write, read_export, tensor_bytes
from draftsmith.export.speculators import speculators_tensors

log = logging.getLogger(__name__)

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"


def sglang_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """draftsmith EAGLE-3 weights under SGLang's names (the speculators mapping, ``layers.0.`` ->
    ``midlayer.``)."""
    tensors = speculators_tensors(
        state, full_vocab=False
    )  # validates the names; d2t/t2d always in our exports
    return {
        (
            ("midlayer." + k.removeprefix("layers.0.")) if k.startswith("layers.0.") else k
        ): v.contiguous()
        for k, v in tensors.items()
    }


def sglang_config(config: dict[str, Any], dtype: str, source: Path) -> dict[str, Any]:
    """The SGLang ``LlamaForCausalLMEagle3`` config.json of a draftsmith EAGLE-3 export config."""
    arch = config["architecture"]
    layers = [int(i) for i in arch["target_layers"]]
    if min(layers) < 1:
        raise ExportError(
            f"{source}: target_layers {layers} taps hidden_states[0] (the embeddings), which SGLang"
            " cannot capture (its ids name layer outputs); retrain with target_layers >= 1"
        )
    return {
        "architectures": [SGLANG_ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "vocab_size": int(arch["vocab_size"]),
        "draft_vocab_size": int(arch["draft_vocab_size"]),
        "hidden_size": int(arch["hidden_size"]),
        "target_hidden_size": int(arch["hidden_size"]),
        "intermediate_size": int(arch["intermediate_size"]),
        "num_attention_heads": int(arch["num_attention_heads"]),
        "num_key_value_heads": int(arch["num_key_value_heads"]),
        "head_dim": int(arch["head_dim"]),
        "rms_norm_eps": float(arch["rms_norm_eps"]),
        "rope_theta": float(arch["rope_theta"]),
        "rope_scaling": None,
        "max_position_embeddings": int(arch["max_position_embeddings"]),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers],
            "use_aux_hidden_state": True,
        },
        "draftsmith": {
            "converted_from": str(source.resolve()),
            "target": config["target"],
            "target_layers": layers,
        },
    }


def to_sglang(
    export_dir: str | Path, out_dir: str | Path, source: str | Path | None = None
) -> Path:
    """Write the SGLang ``LlamaForCausalLMEagle3`` folder of a draftsmith EAGLE-3 export into
    ``out_dir`` (atomically); ``source``: what the user converted, named in errors and the
    config."""
    config, state = read_export(export_dir)
    source = Path(source or export_dir)
    if config["method"] != "eagle3":
        raise ExportError(
            f"--format sglang holds EAGLE-3 drafters (LlamaForCausalLMEagle3); {source} is a "
            f"{config['method']!r} export"
        )
    tensors = sglang_tensors(state)
    out_config = sglang_config(
        config, str(tensors["fc.weight"].dtype).removeprefix("torch."), source
    )

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(out_config, indent=2) + "\n")

    out = atomic_folder_write(
        out_dir, fill, sources=(export_dir, source), size_hint=tensor_bytes(tensors)
    )
    log.info("wrote SGLang %s folder %s", SGLANG_ARCHITECTURE, out)
    return out


def _convert_request(request: ConvertRequest) -> Path:
    return to_sglang(request.export_dir, request.out, source=request.source)


register_format(
    ExportFormat(
        "sglang",
        ("eagle3",),
        _convert_request,
        help="SGLang's LlamaForCausalLMEagle3 layout (--speculative-draft-model-path OUT)",
    )
)
