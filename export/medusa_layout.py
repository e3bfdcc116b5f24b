"""Convert a draftsmith Medusa export into vLLM's Medusa layout (``--format medusa``); shared head
reading for ``export/medusa_tgi.py`` (``--format medusa-tgi``, the FasterDecoding/TGI layout,
written to its own folder).

vLLM (``vllm/model_executor/models/medusa.py`` + ``vllm/transformers_utils/configs/medusa.py``; key
list checked in tests/test_engine_layouts.py): ``config.json`` with ``model_type: medusa``,
``architectures: [MedusaModel]``, ``num_heads``, ``num_hidden_layers`` (ResBlocks per head),
``hidden_size``, ``vocab_size``, ``truncated_vocab_size`` (= vocab_size, or the draft vocabulary's
size), ``medusa_fc_bias: true`` (our ResBlocks have a bias), ``original_lm_head`` (heads share one
LM head), ``max_paths``, ``topk``; weights in ``model.safetensors`` only (vLLM reads every
``*.safetensors`` of the folder) as:

* ``blocks.{head}.layers.{layer}.weight|bias`` [H, H] / [H];
* ``lm_heads.{head}.weight`` [truncated_vocab_size, H] for every head, or, with
  ``original_lm_head``, the one shared head as ``lm_heads.0.weight`` (vLLM loads it into its single
  ``lm_head``; further ``lm_heads.{k}`` would be dropped unread);
* ``token_map`` (int64 target ids of the head's columns) only when ``truncated_vocab_size <
  vocab_size`` (vLLM ignores it otherwise).

No ``medusa_num_heads`` in this config: TGI takes a folder with that key for its own layout and then
needs a config without ``architectures``, so one folder cannot serve both; ``--format medusa-tgi``
writes TGI's.

Field mapping from a draftsmith export: architecture.num_heads -> num_heads; architecture.num_layers
-> num_hidden_layers; architecture.hidden_size/vocab_size as is; heads.{k}.blocks.{j}.linear.* ->
blocks.{k}.layers.{j}.*; heads.{k}.lm_head.weight (or the target's LM head, its draft rows) ->
lm_heads.{k}.weight; draft_ids -> token_map.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from draftsmith.export.converters import ConvertRequest, ExportFormat, register_format
from draftsmith.export.format import (
    ExportError,
    atomic_folder_write,
    read_export_parts,
    tensor_bytes,
)


def read_medusa_export(
    export_dir: str | Path, fmt: str, source: str | Path | None = None
) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]], Path]:
    """``(config, parts, source)`` of a Medusa-1/2 export; other methods are refused naming
    ``fmt``."""
    config, parts = read_export_parts(export_dir)
    source = Path(source or export_dir)
    if config["method"] not in ("medusa", "medusa2"):
        raise ExportError(
            f"--format {fmt} converts Medusa-1/2 exports; {source} holds {config['method']!r}"
        )
    return config, parts, source


def head_lm_weights(
    state: dict[str, torch.Tensor], num_heads: int, lm_head_weight: torch.Tensor | None
) -> list[torch.Tensor]:
    """Each head's LM head [V', H] over the columns it scores (its draft rows when a draft
    vocabulary is set)."""
    heads = []
    draft_ids = state.get("draft_ids")
    for k in range(num_heads):
        head = state.get(f"heads.{k}.lm_head.weight", lm_head_weight)
        if head is None:
            raise ExportError(
                "this export shares the target's LM head: pass the target (--target) so its LM head"
                " can be written into the engine layout"
            )
        # a shared full head: its draft rows
        if draft_ids is not None and head.shape[0] != draft_ids.numel():
            head = head[draft_ids]  # [V', H]
        heads.append(head.contiguous().clone())
    return heads


def block_tensors(state: dict[str, torch.Tensor], k: int, j: int) -> dict[str, torch.Tensor]:
    """``{"weight": [H, H], "bias": [H]}`` of ResBlock ``j`` of head ``k``."""
    return {
        part: state[f"heads.{k}.blocks.{j}.linear.{part}"].contiguous().clone()
        for part in ("weight", "bias")
    }


def vllm_medusa_tensors(
    state: dict[str, torch.Tensor], arch: dict[str, Any], lm_head_weight: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """draftsmith head weights under the names vLLM's ``Medusa.load_weights`` reads (module
    docstring)."""
    num_heads, num_layers = int(arch["num_heads"]), int(arch["num_layers"])
    out: dict[str, torch.Tensor] = {}
    for k in range(num_heads):
        for j in range(num_layers):
            for part, w in block_tensors(state, k, j).items():
                out[f"blocks.{k}.layers.{j}.{part}"] = w
    heads = head_lm_weights(state, num_heads, lm_head_weight)
    shared = bool(arch.get("share_lm_head", False))
    for k, head in enumerate(heads[:1] if shared else heads):
        out[f"lm_heads.{k}.weight"] = head
    truncated = int(arch.get("draft_vocab_size") or arch["vocab_size"])
    if truncated < int(
        arch["vocab_size"]
    ):  # vLLM's truncated vocabulary: column i is target id token_map[i]
        out["token_map"] = state["draft_ids"].to(torch.long).contiguous().clone()
    return out


def vllm_medusa_config(config: dict[str, Any], source: Path) -> dict[str, Any]:
    """The vLLM ``MedusaConfig`` of a draftsmith Medusa export config."""
    arch = config["architecture"]
    inference = config.get("inference") or {}
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": int(arch["hidden_size"]),
        "vocab_size": int(arch["vocab_size"]),
        "num_heads": int(arch["num_heads"]),
        "num_hidden_layers": int(arch["num_layers"]),
        "truncated_vocab_size": int(arch.get("draft_vocab_size") or arch["vocab_size"]),
        "medusa_fc_bias": True,
        "original_lm_head": bool(arch.get("share_lm_head", False)),
        "max_paths": len(inference.get("tree", [])) or 64,
        "topk": int(inference.get("top_k", 10)),
        "draftsmith": {"converted_from": str(source.resolve()), "target": config["target"]},
    }


def to_medusa_layout(
    export_dir: str | Path,
    out_dir: str | Path,
    lm_head_weight: torch.Tensor | None = None,
    source: str | Path | None = None,
) -> Path:
    """Write the vLLM Medusa layout of a draftsmith Medusa export into ``out_dir`` (atomically).
    ``source``: what the user converted (a run folder exported into a temporary folder first), named
    in errors and the layout.
    """
    config, parts, source = read_medusa_export(export_dir, "medusa", source)
    tensors = vllm_medusa_tensors(parts["model"], config["architecture"], lm_head_weight)
    engine_config = vllm_medusa_config(config, source)

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(engine_config, indent=2) + "\n")
        write_adapter(tmp, config, parts)

    return atomic_folder_write(
        out_dir, fill, sources=(export_dir, source), size_hint=tensor_bytes(parts)
    )


def write_adapter(
    folder: Path, config: dict[str, Any], parts: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Medusa-2 changed the target: its LoRA in peft's layout under ``folder/lora`` (engines serving
    base + LoRA)."""
    adapter = (config.get("inference") or {}).get("adapter")
    if adapter:
        write_peft_lora(
            folder / "lora",
            parts[adapter.get("part", "adapter")],
            adapter,
            config["target"]["name_or_path"],
        )


def write_peft_lora(out: Path, part: dict[str, torch.Tensor], block: dict, base: str) -> None:
    """A Medusa-2 adapter part as a peft LoRA folder (``adapter_config.json`` +
    ``adapter_model.safetensors``, keys ``base_model.model.<module path>.lora_A.weight``): vLLM and
    peft load it on the base model the heads need.
    """
    out.mkdir(parents=True)
    save_file(
        {f"base_model.model.{k}": v.contiguous() for k, v in part.items()},
        str(out / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(block["rank"]),
        "lora_alpha": float(block["alpha"]),
        "target_modules": list(block.get("target_modules", [])),
        "lora_dropout": 0.0,
        "bias": "none",
        "base_model_name_or_path": base,
    }
    (out / "adapter_config.json").write_text(json.dumps(peft_config, indent=2) + "\n")


MEDUSA_METHODS = ("medusa", "medusa2")


def _convert_request(request: ConvertRequest) -> Path:
    """``--format medusa``: heads sharing the target's LM head get it from the recorded target (or
    ``--target``)."""
    shared = bool(request.config["architecture"].get("share_lm_head", False))
    lm_head = request.host.lm_head(request.verifier_folder()) if request.target or shared else None
    return to_medusa_layout(request.export_dir, request.out, lm_head, source=request.source)


register_format(
    ExportFormat("medusa", MEDUSA_METHODS, _convert_request, help="vLLM's Medusa layout")
)
