"""The SGLang EAGLE-3 layout against the key list SGLang's own loader reads: zero unknown, zero
missing, right shapes, ``d2t`` reproducing our draft map, and a clear refusal of what it cannot
hold.

``sglang_load`` below re-implements ONLY the engine's name mapping (which checkpoint name lands in
which parameter, which names it skips) and its parameter list with shapes, written down from these
sources:

* SGLang ``LlamaForCausalLMEagle3``: sgl-project/sglang ``python/sglang/srt/models/llama_eagle3.py``
  @ 03d5a7771f6082e7737a5f19cae7d1e863087013 (``LlamaModel``/``LlamaForCausalLMEagle3.__init__``
  parameters, ``load_weights``: ``d2t`` -> hot token ids ``d2t + arange``, ``t2d`` skipped, q/k/v
  and gate/up stacked, a name missing from the parameters retried with ``model.``, anything else
  dropped silently) and ``python/sglang/srt/models/llama.py`` @
  00239548f1cd1a06ca145a5447a86738090a48f1 (``set_eagle3_layers_to_capture``: ``layers_to_capture =
  [val + 1 for val in layer_ids]``, captured at the INPUT of those layers); the embedding comes from
  the target (``eagle_worker``: ``set_embed``), so the draft checkpoint need not hold it.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import build_tiny_llama
from safetensors.torch import load_file
from test_engine_layouts import medusa_export
from test_speculators_export import export_eagle3

from draftsmith.distill.target.frozen import Target
from draftsmith.export.format import ExportError, read_export
from draftsmith.export.sglang import to_sglang
from draftsmith.export.speculators import to_speculators

pytestmark = pytest.mark.unit


@pytest.fixture()
def target(tiny_tokenizer) -> Target:
    return Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")


SGLANG_STACKED = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)


SGLANG_FROM_TARGET = {
    "model.embed_tokens.weight"
}  # eagle_worker: draft_model.set_embed(target embedding)


def sglang_params(cfg: dict) -> dict[str, tuple[int, ...]]:
    """``dict(LlamaForCausalLMEagle3(cfg).named_parameters())`` as name -> shape (one layer, untied
    head)."""
    h, hd, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    m = "model.midlayer."
    params = {
        "model.embed_tokens.weight": (cfg["vocab_size"], h),
        "model.fc.weight": (h, 3 * cfg.get("target_hidden_size", h)),
        m + "self_attn.qkv_proj.weight": (q + 2 * kv, 2 * h),
        m + "self_attn.o_proj.weight": (h, q),
        m + "mlp.gate_up_proj.weight": (2 * inter, h),
        m + "mlp.down_proj.weight": (h, inter),
        **{
            f"{m}{n}.weight": (h,)
            for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")
        },
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg["draft_vocab_size"], h),
    }
    if cfg.get("bias", False):
        params["model.fc.bias"] = (h,)
    return params


def sglang_load(cfg: dict, tensors: dict[str, torch.Tensor]) -> SimpleNamespace:
    """SGLang's ``load_weights`` name mapping over ``tensors``: unknown names, missing parameters,
    bad shapes and the hot token ids it builds from ``d2t``."""
    assert cfg["num_hidden_layers"] == 1 and not cfg.get("tie_word_embeddings", False)
    params = sglang_params(cfg)
    hd, inter = cfg["head_dim"], cfg["intermediate_size"]
    shard_rows = {
        "q": cfg["num_attention_heads"] * hd,
        "k": cfg["num_key_value_heads"] * hd,
        "v": cfg["num_key_value_heads"] * hd,
        0: inter,
        1: inter,
    }
    loaded: dict[str, set] = {}
    unknown, wrong, hot = [], [], None
    for original, w in tensors.items():
        name = original
        if "d2t" in name:
            hot = w + torch.arange(w.shape[0])
            continue
        if "t2d" in name:
            continue
        for param_name, shard_name, shard in SGLANG_STACKED:
            if shard_name in name:
                name = name.replace(shard_name, param_name)
                key = name if name in params else f"model.{name}"
                want = (shard_rows[shard], params[key][1]) if key in params else None
                break
        else:
            shard = None
            key = name if name in params else f"model.{name}"
            want = params.get(key)
        if key not in params:
            unknown.append(original)
            continue
        if tuple(w.shape) != want:
            wrong.append((original, tuple(w.shape), want))
        loaded.setdefault(key, set()).add(shard)
    stacked = {"self_attn.qkv_proj": {"q", "k", "v"}, "mlp.gate_up_proj": {0, 1}}
    missing = sorted(
        k
        for k in params
        if k not in SGLANG_FROM_TARGET
        and (
            k not in loaded
            or any(part in k and loaded[k] != shards for part, shards in stacked.items())
        )
    )
    return SimpleNamespace(unknown=unknown, missing=missing, wrong=wrong, hot=hot)


def test_sglang_layout_loads_every_parameter_and_d2t_reproduces_our_draft_map(tmp_path, target):
    export, drafter = export_eagle3(
        target, tmp_path / "export"
    )  # draft vocab 48, taps hidden_states[1, 2, 3]
    out = to_sglang(export, tmp_path / "sglang")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["draft_vocab_size"], cfg["vocab_size"]) == (
        1,
        48,
        target.vocab_size,
    )
    assert cfg["tie_word_embeddings"] is False and cfg["target_hidden_size"] == target.hidden_size
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    # SGLang captures the input of id + 1
    assert [i + 1 for i in ids] == list(drafter.tapped_layers) == [1, 2, 3]
    tensors = load_file(out / "model.safetensors")
    report = sglang_load(cfg, tensors)
    assert (report.unknown, report.missing, report.wrong) == ([], [], [])
    assert torch.equal(
        report.hot, drafter.draft_to_target(torch.arange(48))
    )  # d2t[i] = target id - i
    assert torch.equal(
        tensors["midlayer.self_attn.q_proj.weight"], drafter.layer.self_attn.q_proj.weight
    )
    assert (
        torch.equal(tensors["lm_head.weight"], drafter.lm_head.weight)
        and "embed_tokens.weight" not in tensors
    )

    full, _ = export_eagle3(
        target, tmp_path / "export_full", draft_vocab=0
    )  # full vocabulary: d2t all zeros
    full_out = to_sglang(full, tmp_path / "sglang_full")
    full_report = sglang_load(
        json.loads((full_out / "config.json").read_text()),
        load_file(full_out / "model.safetensors"),
    )
    assert (full_report.unknown, full_report.missing) == ([], [])
    assert torch.equal(full_report.hot, torch.arange(target.vocab_size))


def test_the_sglang_check_fails_on_unknown_and_missing_names(tmp_path, target):
    export, _ = export_eagle3(target, tmp_path / "export")
    spec = to_speculators(
        export, tmp_path / "spec", "org/model"
    )  # layers.0.* names: SGLang would drop them
    report = sglang_load(
        json.loads((to_sglang(export, tmp_path / "sg") / "config.json").read_text()),
        load_file(spec / "model.safetensors"),
    )
    assert "layers.0.self_attn.q_proj.weight" in report.unknown
    assert "model.midlayer.self_attn.qkv_proj.weight" in report.missing


def test_sglang_refuses_what_it_cannot_hold(tmp_path, target):
    medusa, _ = medusa_export(target, tmp_path / "medusa")
    with pytest.raises(ExportError, match="EAGLE-3"):
        to_sglang(medusa, tmp_path / "x")
    export, _ = export_eagle3(target, tmp_path / "export")
    config, _ = read_export(export)
    config["architecture"]["target_layers"] = [0, 2, 3]
    (export / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=r"hidden_states\[0\]"):
        to_sglang(export, tmp_path / "y")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
