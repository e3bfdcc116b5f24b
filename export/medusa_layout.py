"""Convert a draftsmith Medusa export into the layouts real engines read.

One output folder serves both consumers:

* vLLM (``vllm/model_executor/models/medusa.py``): ``config.json`` with ``model_type: medusa``,
  ``architectures: [MedusaModel]``, ``num_heads``, ``num_hidden_layers`` (ResBlocks per head), ``hidden_size``,
  ``vocab_size``, ``truncated_vocab_size`` (= vocab_size, or the draft vocabulary's size with a ``token_map``
  tensor of its target ids), ``medusa_fc_bias: true`` (our ResBlocks
  have a bias), ``original_lm_head`` (heads share one LM head); weights in ``model.safetensors`` as
  ``blocks.{head}.layers.{layer}.weight|bias`` and ``lm_heads.{head}.weight``.
* The original FasterDecoding/Medusa layout read by TGI: the same ``config.json`` also carries
  ``medusa_num_heads``, ``medusa_num_layers`` and ``base_model_name_or_path``; weights in
  ``medusa_lm_head.safetensors`` as ``{head}.{layer}.linear.weight|bias`` and ``{head}.{num_layers}.weight``.

Field mapping from a draftsmith export: architecture.num_heads -> num_heads / medusa_num_heads;
architecture.num_layers -> num_hidden_layers / medusa_num_layers; architecture.hidden_size/vocab_size as is;
target.name_or_path -> base_model_name_or_path; heads.{k}.blocks.{j}.linear.* -> blocks.{k}.layers.{j}.* and
{k}.{j}.linear.*; heads.{k}.lm_head.weight -> lm_heads.{k}.weight and {k}.{num_layers}.weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.export.format import ExportError, atomic_folder_write, read_export_parts


def medusa_layout_tensors(
    state: dict[str, torch.Tensor], num_heads: int, num_layers: int, lm_head_weight: torch.Tensor | None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Map draftsmith head weights to (vLLM keys, original-Medusa keys)."""
    vllm: dict[str, torch.Tensor] = {}
    original: dict[str, torch.Tensor] = {}
    for k in range(num_heads):
        for j in range(num_layers):
            for part in ("weight", "bias"):
                w = state[f"heads.{k}.blocks.{j}.linear.{part}"].contiguous()
                vllm[f"blocks.{k}.layers.{j}.{part}"] = w
                original[f"{k}.{j}.linear.{part}"] = w.clone()
        head = state.get(f"heads.{k}.lm_head.weight", lm_head_weight)
        if head is None:
            raise ExportError("this export shares the target's LM head: pass the target (--target) so its LM head "
                              "can be written into the engine layout")
        draft_ids = state.get("draft_ids")
        if draft_ids is not None and head.shape[0] != draft_ids.numel():  # a shared full head: its draft rows
            head = head[draft_ids]  # [V', H]
        vllm[f"lm_heads.{k}.weight"] = head.contiguous().clone()
        original[f"{k}.{num_layers}.weight"] = head.contiguous().clone()
    if "draft_ids" in state:  # vLLM's truncated vocabulary: logits of column i belong to target id token_map[i]
        vllm["token_map"] = state["draft_ids"].to(torch.long).contiguous().clone()
    return vllm, original


def to_medusa_layout(export_dir: str | Path, out_dir: str | Path, lm_head_weight: torch.Tensor | None = None,
                     source: str | Path | None = None) -> Path:
    """Write the vLLM/TGI Medusa layout of a draftsmith Medusa export into ``out_dir`` (atomically). ``source``: what
    the user converted (a run folder exported into a temporary folder first), named in errors and the layout."""
    config, parts = read_export_parts(export_dir)
    state = parts["model"]
    source = Path(source or export_dir)
    if config["method"] not in ("medusa", "medusa2"):
        raise ExportError(f"--format medusa converts Medusa-1/2 exports; {source} holds {config['method']!r}")
    adapter = (config.get("inference") or {}).get("adapter")
    arch = config["architecture"]
    vllm, original = medusa_layout_tensors(state, arch["num_heads"], arch["num_layers"], lm_head_weight)
    engine_config = {
        "model_type": "medusa", "architectures": ["MedusaModel"],
        "hidden_size": arch["hidden_size"], "vocab_size": arch["vocab_size"],
        "num_heads": arch["num_heads"], "num_hidden_layers": arch["num_layers"],
        "truncated_vocab_size": arch.get("draft_vocab_size") or arch["vocab_size"], "medusa_fc_bias": True,
        "original_lm_head": bool(arch.get("share_lm_head", False)),
        "max_paths": len(config.get("inference", {}).get("tree", [])) or 64,
        "topk": int(config.get("inference", {}).get("top_k", 10)),
        "medusa_num_heads": arch["num_heads"], "medusa_num_layers": arch["num_layers"],
        "base_model_name_or_path": config["target"]["name_or_path"],
        "draftsmith": {"converted_from": str(source.resolve()), "target": config["target"]},
    }

    reduced = bool(arch.get("draft_vocab_size"))
    if reduced:  # the original layout has no token map: a reduced head cannot be written there faithfully
        engine_config["draftsmith"]["medusa_lm_head"] = (
            "not written: these heads score a draft vocabulary of "
            f"{arch['draft_vocab_size']} tokens, which only vLLM's layout (truncated_vocab_size + token_map) can "
            "express; train with heads.draft_vocab_size=null for TGI / the original Medusa code")

    def fill(tmp: Path) -> None:
        save_file(vllm, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if not reduced:
            save_file(original, str(tmp / "medusa_lm_head.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(engine_config, indent=2) + "\n")
        if adapter:  # Medusa-2 changed the target: its LoRA in peft's layout, for engines that serve base + LoRA
            write_peft_lora(tmp / "lora", parts[adapter.get("part", "adapter")], adapter,
                            config["target"]["name_or_path"])

    return atomic_folder_write(out_dir, fill)


def write_peft_lora(out: Path, part: dict[str, torch.Tensor], block: dict, base: str) -> None:
    """A Medusa-2 adapter part as a peft LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``, keys
    ``base_model.model.<module path>.lora_A.weight``): vLLM and peft load it on the base model the heads need."""
    out.mkdir(parents=True)
    save_file({f"base_model.model.{k}": v.contiguous() for k, v in part.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(block["rank"]),
                   "lora_alpha": float(block["alpha"]), "target_modules": list(block.get("target_modules", [])),
                   "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": base}
    (out / "adapter_config.json").write_text(json.dumps(peft_config, indent=2) + "\n")
