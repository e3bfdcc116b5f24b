"""Convert a draftsmith Medusa export into the FasterDecoding/Medusa layout TGI reads (``--format
medusa-tgi``).

TGI (``server/text_generation_server/models/__init__.py``, ``layers/speculative.py``,
``layers/medusa.py``; key list checked in tests/test_engine_layouts.py) serves ``--model-id OUT``: a
``config.json`` holding ``medusa_num_heads`` makes it load ``base_model_name_or_path`` as the model
and ``medusa_lm_head.safetensors`` as its heads. The config must NOT carry ``architectures``: TGI
then routes to the MLP speculator (or to no speculator at all); only a config without it reaches
``MedusaHeadV1``. Weights, for head ``i < medusa_num_heads`` and ResBlock ``j < medusa_num_layers``
(FasterDecoding's ``nn.Sequential(ResBlock * n, Linear(H, V, bias=False))`` state dict):

* ``{i}.{j}.linear.weight`` [H, H] and ``{i}.{j}.linear.bias`` [H];
* ``{i}.{medusa_num_layers}.weight`` [V, H]: the head's LM head over the FULL target vocabulary (TGI
  stacks the heads' logits with the base model's), so exports with a reduced draft vocabulary are
  refused here (vLLM's layout, ``--format medusa``, has a token map for them).

Heads that share the target's LM head get a copy of it per head (pass the target). A Medusa-2 export
also gets its LoRA under ``lora/`` (peft layout): its heads were trained on the adapted target, so
serve base + that adapter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from draftsmith.export.converters import ConvertRequest, ExportFormat, register_format
from draftsmith.export.format import ExportError, atomic_folder_write, tensor_bytes
from draftsmith.export.medusa_layout import (
    MEDUSA_METHODS,
    block_tensors,
    head_lm_weights,
    read_medusa_export,
    write_adapter,
)

TGI_WEIGHTS_FILE = "medusa_lm_head.safetensors"


def tgi_medusa_tensors(
    state: dict[str, torch.Tensor], arch: dict[str, Any], lm_head_weight: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """draftsmith head weights under FasterDecoding/TGI names (module docstring)."""
    num_heads, num_layers = int(arch["num_heads"]), int(arch["num_layers"])
    out: dict[str, torch.Tensor] = {}
    for i, head in enumerate(head_lm_weights(state, num_heads, lm_head_weight)):
        for j in range(num_layers):
            for part, w in block_tensors(state, i, j).items():
                out[f"{i}.{j}.linear.{part}"] = w
        out[f"{i}.{num_layers}.weight"] = head
    return out


def to_medusa_tgi(
    export_dir: str | Path,
    out_dir: str | Path,
    base_model_name_or_path: str,
    lm_head_weight: torch.Tensor | None = None,
    source: str | Path | None = None,
) -> Path:
    """Write the TGI/FasterDecoding Medusa layout of a draftsmith Medusa export into ``out_dir``
    (atomically).

    ``base_model_name_or_path``: what TGI loads as the model (a hub id or a folder; the target the
    heads were trained on); ``lm_head_weight``: the target's LM head, needed when the heads share
    it; ``source``: named in errors.
    """
    config, parts, source = read_medusa_export(export_dir, "medusa-tgi", source)
    arch = config["architecture"]
    if arch.get("draft_vocab_size") and int(arch["draft_vocab_size"]) < int(arch["vocab_size"]):
        raise ExportError(
            f"{source}: these heads score a draft vocabulary of {arch['draft_vocab_size']} of "
            f"{arch['vocab_size']} tokens; TGI's Medusa heads must score the full vocabulary. Use "
            "--format medusa (vLLM: truncated_vocab_size + token_map), or train with "
            "heads.draft_vocab_size=null for TGI"
        )
    tensors = tgi_medusa_tensors(parts["model"], arch, lm_head_weight)
    engine_config = {
        "medusa_num_heads": int(arch["num_heads"]),
        "medusa_num_layers": int(arch["num_layers"]),
        "base_model_name_or_path": base_model_name_or_path,
        "hidden_size": int(arch["hidden_size"]),
        "vocab_size": int(arch["vocab_size"]),
        "draftsmith": {"converted_from": str(source.resolve()), "target": config["target"]},
    }

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / TGI_WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(engine_config, indent=2) + "\n")
        write_adapter(tmp, config, parts)

    return atomic_folder_write(
        out_dir, fill, sources=(export_dir, source), size_hint=tensor_bytes(parts)
    )


def _convert_request(request: ConvertRequest) -> Path:
    """``--format medusa-tgi``: TGI loads the base model the config names, the target, always."""
    base = request.verifier_folder()
    shared = bool(request.config["architecture"].get("share_lm_head", False))
    lm_head = request.host.lm_head(base) if request.target or shared else None
    return to_medusa_tgi(request.export_dir, request.out, base, lm_head, source=request.source)


register_format(
    ExportFormat(
        "medusa-tgi", MEDUSA_METHODS, _convert_request, help="the FasterDecoding/TGI Medusa layout"
    )
)
