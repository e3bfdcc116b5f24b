"""DFlash's vLLM layout (speculators ``dflash`` type): the config vLLM builds from it
(``update_dflash``) taps the hidden states the drafter trained on, and ``DFlashQwen3ForCausalLM``'s
loader, mirrored here, finds every parameter with our weights; the check fails on a wrong layout.
The sources each rule follows are cited in tests/test_dflash_export.py's docstring."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from dflash_exports import TAPS, export_dflash, tiny_llama_target
from safetensors.torch import load_file

from draftsmith.distill.target.frozen import Target
from draftsmith.export.dflash import to_zlab
from draftsmith.export.speculators import to_speculators
from draftsmith.export.speculators_dflash import to_speculators_dflash

pytestmark = pytest.mark.unit


@pytest.fixture()
def target(tiny_tokenizer) -> Target:
    return tiny_llama_target(tiny_tokenizer)


# ---- vLLM DFlashQwen3ForCausalLM (speculators dflash) --------------------------------------------
VLLM_STACKED = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)
VLLM_FROM_TARGET = {
    "lm_head.weight",
    "model.embed_tokens.weight",
}  # skipped / shared when the draft has none


def vllm_dflash_config(raw: dict) -> dict:
    """The HF config vLLM builds from a speculators dflash config.json (``update_dflash``)."""
    aux = raw["aux_hidden_state_layer_ids"]
    return {
        **raw["transformer_layer_config"],
        "architectures": ["DFlashDraftModel"],
        "draft_vocab_size": raw.get("draft_vocab_size"),
        "target_hidden_size": raw["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": aux,
        "dflash_config": {
            "mask_token_id": raw["mask_token_id"],
            "target_layer_ids": [i - 1 for i in aux],
        },
    }


def vllm_dflash_load(cfg: dict, tensors: dict[str, torch.Tensor]) -> SimpleNamespace:
    """vLLM's parameters and ``load_weights`` name mapping over ``tensors``."""
    h, d, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    layer_ids = cfg[
        "eagle_aux_hidden_state_layer_ids"
    ]  # _resolve_dflash_layer_ids: no dflash_config.layer_ids
    params = {
        "model.fc.weight": (h, cfg["target_hidden_size"] * len(layer_ids)),
        "model.hidden_norm.weight": (h,),
        "model.norm.weight": (h,),
        "model.embed_tokens.weight": (cfg["vocab_size"], h),
        "lm_head.weight": (cfg["draft_vocab_size"] or cfg["vocab_size"], h),
    }
    for i in range(cfg["num_hidden_layers"]):
        m = f"model.layers.{i}."
        params.update(
            {
                m + "self_attn.qkv_proj.weight": (q + 2 * kv, h),
                m + "self_attn.o_proj.weight": (h, q),
                m + "self_attn.q_norm.weight": (d,),
                m + "self_attn.k_norm.weight": (d,),
                m + "mlp.gate_up_proj.weight": (2 * inter, h),
                m + "mlp.down_proj.weight": (h, inter),
                m + "input_layernorm.weight": (h,),
                m + "post_attention_layernorm.weight": (h,),
            }
        )
    rows = {"q": q, "k": kv, "v": kv, 0: inter, 1: inter}
    loaded: dict[str, set] = {}
    unknown, wrong = [], []
    for original, w in tensors.items():
        if "t2d" in original or "d2t" in original:
            continue
        name = original if "lm_head" in original else "model." + original
        want, shard = None, None
        for param_name, weight_name, shard_id in VLLM_STACKED:
            if weight_name in name:
                name, shard = name.replace(weight_name, param_name), shard_id
                want = (rows[shard_id], params[name][1]) if name in params else None
                break
        else:
            want = params.get(name)
        if name not in params:
            unknown.append(original)  # vLLM: KeyError in params_dict[name]
            continue
        if tuple(w.shape) != want:
            wrong.append((original, tuple(w.shape), want))
        loaded.setdefault(name, set()).add(shard)
    stacked = {"qkv_proj": {"q", "k", "v"}, "gate_up_proj": {0, 1}}
    missing = sorted(
        k
        for k in params
        if k not in VLLM_FROM_TARGET
        and (
            k not in loaded
            or any(part in k and loaded[k] != shards for part, shards in stacked.items())
        )
    )
    return SimpleNamespace(unknown=unknown, missing=missing, wrong=wrong)


def test_speculators_dflash_layout_loads_every_vllm_parameter(tmp_path, target):
    export, drafter = export_dflash(target, tmp_path / "export")
    out = to_speculators(
        export, tmp_path / "spec", "org/tiny"
    )  # delegates to export/speculators_dflash.py
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    raw = json.loads((out / "config.json").read_text())
    assert (
        raw["speculators_model_type"] == "dflash"
        and raw["speculators_config"]["algorithm"] == "dflash"
    )
    # block_size - 1
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert raw["speculators_config"]["verifier"] == {
        "name_or_path": "org/tiny",
        "architectures": ["LlamaForCausalLM"],
    }
    assert (raw["aux_hidden_state_layer_ids"], raw["mask_token_id"], raw["block_size"]) == (
        TAPS,
        drafter.config.mask_token_id,
        4,
    )
    assert raw["sample_from_anchor"] is False and raw["draft_vocab_size"] == target.vocab_size
    layer = raw["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["vocab_size"]) == (
        "qwen3",
        2,
        target.vocab_size,
    )
    cfg = vllm_dflash_config(raw)
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 1, 2]  # = the z-lab ids of the same taps
    tensors = load_file(out / "model.safetensors")
    report = vllm_dflash_load(cfg, tensors)
    assert (report.unknown, report.missing, report.wrong) == ([], [], [])
    assert torch.equal(tensors["layers.1.mlp.up_proj.weight"], drafter.layers[1].mlp.up_proj.weight)
    assert set(tensors) == set(
        load_file(to_zlab(export, tmp_path / "z") / "model.safetensors")
    )  # same body
    bf16 = load_file(
        to_speculators_dflash(export, tmp_path / "bf16", "org/tiny", dtype="bfloat16")
        / "model.safetensors"
    )
    assert bf16["fc.weight"].dtype == torch.bfloat16


def test_the_vllm_check_fails_on_a_wrong_layout(tmp_path, target):
    export, _ = export_dflash(target, tmp_path / "export")
    out = to_speculators(export, tmp_path / "spec", "org/tiny")
    cfg = vllm_dflash_config(json.loads((out / "config.json").read_text()))
    tensors = load_file(out / "model.safetensors")
    renamed = {k.replace("layers.", "blocks."): v for k, v in tensors.items()}
    report = vllm_dflash_load(cfg, renamed)
    assert "blocks.0.self_attn.q_proj.weight" in report.unknown
    assert "model.layers.0.self_attn.qkv_proj.weight" in report.missing
    no_k = vllm_dflash_load(
        cfg, {k: v for k, v in tensors.items() if k != "layers.0.self_attn.k_proj.weight"}
    )
    assert no_k.missing == [
        "model.layers.0.self_attn.qkv_proj.weight"
    ]  # a shard short of the stacked parameter
