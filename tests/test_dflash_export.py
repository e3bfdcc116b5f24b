"""DFlash exports: the z-lab layout, vLLM's speculators ``dflash`` type and llama.cpp's GGUF,
against the engines (the vLLM layout's loader check: tests/test_dflash_vllm_layout.py).

Layer ids. Each test below pins the ids a format writes against the ``hidden_states`` the drafter
trained on (draftsmith ``target_layers``: HF ``hidden_states`` indices, 0 = embeddings), following
each engine's own source:

* z-lab/dflash ``dflash/model.py`` @ 44947fbf71114e241c96de194f4b382b5dd330d0:
  ``extract_context_feature`` reads ``hidden_states[layer_id + 1]`` for
  ``dflash_config.target_layer_ids``; ``DFlashDraftModel.__init__`` has ``layers.{i}``
  (``Qwen3DFlashDecoderLayer``: ``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``,
  ``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``), ``norm``, ``fc``
  [H, len(ids) * H] (no bias), ``hidden_norm``; no embedding, no LM head (the target's,
  ``dflash_generate``).
* vLLM: ``vllm/transformers_utils/configs/speculators/algos.py`` ``update_dflash``
  (vllm-project/vllm #40727, merged 2026-04-23): ``eagle_aux_hidden_state_layer_ids = aux``,
  ``dflash_config.target_layer_ids = aux - 1``; vLLM captures ``eagle_aux`` ids at the input of
  those target layers (``hidden_states[aux]``). The loader:
  ``vllm/model_executor/models/qwen3_dflash.py`` @ d952bda805e64a425276f59161a915d31abbfd13
  (``DFlashQwen3ForCausalLM.load_weights``: ``t2d`` skipped, ``d2t`` -> ``draft_id_to_target_id``,
  every name without ``lm_head`` gets ``model.``, q/k/v -> ``qkv_proj`` and gate/up ->
  ``gate_up_proj``, ``embed_tokens`` and the draft map skipped when absent; ``DFlashQwen3Model``:
  ``fc`` [H, target_hidden_size * len(layer ids)], ``hidden_norm``, ``norm``; the LM head is the
  target's when the checkpoint has none).
* speculators 0.9.0 (``.cache/venv-speculators``): ``DFlashSpeculatorConfig``, ``DFlashDraftModel``
  and ``convert/dflash/converter.py`` (z-lab -> speculators: ``aux = target_layer_ids + 1``) run for
  real (e2e, in tests/test_dflash_engines.py).
* llama.cpp (the cached ``make llamacpp`` build, llama-cpp-python 0.3.36's vendored tree):
  ``conversion/qwen.py`` ``DFlashModel`` writes ``target_layers = target_layer_ids + 1`` and
  ``common/speculative.cpp`` captures the input of those target layers
  (``llama_set_embeddings_layer_inp``); ``src/models/dflash.cpp`` ``load_arch_tensors`` names the
  tensors it requires (checked on the real converter's output in tests/test_dflash_engines.py,
  integration).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from dflash_exports import export_dflash, tiny_llama_target
from safetensors.torch import load_file

from draftsmith.cli import main
from draftsmith.cli.exporting import _convert
from draftsmith.distill.target.frozen import Target
from draftsmith.export.dflash import to_zlab, zlab_layer_ids
from draftsmith.export.format import ExportError, read_export
from draftsmith.export.gguf import converter_input
from draftsmith.export.speculators import to_speculators
from draftsmith.export.speculators_dflash import speculators_aux_ids

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def target(tiny_tokenizer) -> Target:
    return tiny_llama_target(tiny_tokenizer)


def _rewrite(export: Path, **arch) -> Path:
    config, _ = read_export(export)
    config["architecture"].update(arch)
    (export / "config.json").write_text(json.dumps(config))
    return export


# ---- ids: one table, every format against the hidden states the drafter trained on ---------------
def test_each_format_taps_the_hidden_states_the_drafter_trained_on():
    taps = [2, 9, 16]  # draftsmith: hidden_states[2], [9], [16]
    zlab, aux = zlab_layer_ids(taps), speculators_aux_ids(taps)
    assert zlab == [1, 8, 15] and aux == [2, 9, 16]
    assert [
        i + 1 for i in zlab
    ] == taps  # z-lab extract_context_feature: hidden_states[layer_id + 1]
    assert [
        i + 1 for i in zlab
    ] == taps  # llama.cpp converter: target_layers = id + 1, captured at the layer input
    vllm_dflash_ids = [
        i - 1 for i in aux
    ]  # vLLM update_dflash: dflash_config.target_layer_ids = aux - 1
    # captured at input of id + 1
    assert vllm_dflash_ids == zlab and [i + 1 for i in vllm_dflash_ids] == taps
    assert [
        i + 1 for i in zlab
    ] == aux  # speculators' own DFlashConverter (z-lab -> speculators): aux = id + 1


def test_zlab_taps_equal_ours_on_a_real_forward(tmp_path, target):
    export, drafter = export_dflash(target, tmp_path / "export")
    cfg = json.loads((to_zlab(export, tmp_path / "zlab") / "config.json").read_text())
    ids = torch.randint(4, target.vocab_size, (1, 7))
    with torch.no_grad():
        hidden = target.model(ids, output_hidden_states=True).hidden_states
    zlab = torch.cat(
        [hidden[i + 1] for i in cfg["dflash_config"]["target_layer_ids"]], -1
    )  # z-lab's extraction
    ours = torch.cat([hidden[i] for i in drafter.tapped_layers], -1)
    assert torch.equal(zlab, ours)


# ---- z-lab DFlashDraftModel ----------------------------------------------------------------------
def zlab_params(cfg: dict) -> dict[str, tuple[int, ...]]:
    """``dict(DFlashDraftModel(cfg).named_parameters())`` as name -> shape (attention_bias
    false)."""
    h, d, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    layer = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    n_ids = len(cfg["dflash_config"]["target_layer_ids"])
    return {
        "norm.weight": (h,),
        "fc.weight": (h, n_ids * h),
        "hidden_norm.weight": (h,),
        **{f"layers.{i}.{k}": s for i in range(cfg["num_hidden_layers"]) for k, s in layer.items()},
    }


def key_report(
    params: dict[str, tuple[int, ...]], tensors: dict[str, torch.Tensor]
) -> SimpleNamespace:
    """``load_state_dict(strict=True)``'s verdict: unknown names, missing parameters, wrong
    shapes."""
    return SimpleNamespace(
        unknown=sorted(set(tensors) - set(params)),
        missing=sorted(set(params) - set(tensors)),
        wrong=[
            (k, tuple(w.shape))
            for k, w in tensors.items()
            if params.get(k, tuple(w.shape)) != tuple(w.shape)
        ],
    )


def test_zlab_layout_loads_every_parameter_with_our_weights(tmp_path, target):
    export, drafter = export_dflash(target, tmp_path / "export")
    out = to_zlab(export, tmp_path / "zlab")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {
        "block_size": 4,
        "mask_token_id": drafter.config.mask_token_id,
        "target_layer_ids": [0, 1, 2],
    }
    assert (cfg["block_size"], cfg["num_target_layers"], cfg["is_causal"]) == (4, 4, False)
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["num_hidden_layers"] == 2
    assert (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    ) == (64, 4, 2, 16)
    tensors = load_file(out / "model.safetensors")
    report = key_report(zlab_params(cfg), tensors)
    assert (report.unknown, report.missing, report.wrong) == ([], [], [])
    state = drafter.state_dict()
    assert all(torch.equal(tensors[k], state[k]) for k in tensors)
    assert not any(
        "embed" in k or "lm_head" in k for k in tensors
    )  # the target's, never in the draft checkpoint


def test_the_zlab_check_fails_on_a_wrong_layout(tmp_path, target):
    export, _ = export_dflash(target, tmp_path / "export")
    cfg = json.loads((to_zlab(export, tmp_path / "zlab") / "config.json").read_text())
    tensors = load_file(tmp_path / "zlab" / "model.safetensors")
    prefixed = key_report(zlab_params(cfg), {f"model.{k}": v for k, v in tensors.items()})
    assert "model.fc.weight" in prefixed.unknown and "fc.weight" in prefixed.missing
    two_taps = key_report(
        zlab_params({**cfg, "dflash_config": {"target_layer_ids": [0, 1]}}), tensors
    )
    assert two_taps.wrong == [("fc.weight", (64, 3 * 64))]


# ---- refusals and the CLI ------------------------------------------------------------------------
def test_bad_exports_are_refused_with_the_reason(tmp_path, target):
    export, _ = export_dflash(target, tmp_path / "export")
    _rewrite(export, mask_token_id=target.vocab_size)
    for convert in (
        lambda: to_zlab(export, tmp_path / "a"),
        lambda: to_speculators(export, tmp_path / "b", "o/t"),
        lambda: converter_input(export, tmp_path / "c", tmp_path),
    ):
        with pytest.raises(
            ExportError, match=r"mask_token_id \d+ is outside the target vocabulary"
        ):
            convert()
    tap0, _ = export_dflash(target, tmp_path / "tap0", layers=[0, 2, 3])
    with pytest.raises(ExportError, match=r"taps hidden_states\[0\] have no layer id"):
        to_zlab(tap0, tmp_path / "d")
    assert not any((tmp_path / n).exists() for n in "abd")
    with pytest.raises(ValueError) as err:  # the method table names what DFlash exports as
        _convert(tmp_path, tmp_path / "out", "sglang", {"method": "dflash"}, None, source="runs/x")
    assert "DFlash exports as: draftsmith, dflash-zlab, speculators, gguf" in str(err.value)
    with pytest.raises(ValueError) as err:
        _convert(
            tmp_path, tmp_path / "out", "dflash-zlab", {"method": "eagle3"}, None, source="runs/x"
        )
    assert "--format dflash-zlab does not hold 'eagle3' exports" in str(err.value)
    assert "EAGLE-3 exports as: draftsmith, speculators, sglang, gguf" in str(err.value)


def test_optional_heads_are_left_out_and_named(tmp_path, target, caplog):
    export, drafter = export_dflash(target, tmp_path / "export", heads=True)
    assert any(k.startswith("markov_head.") for k in drafter.state_dict())
    with caplog.at_level("WARNING"):
        out = to_zlab(export, tmp_path / "zlab")
    assert "no slot for draftsmith's ['confidence_head', 'markov_head']" in caplog.text
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draftsmith"]["dropped"] == ["confidence_head", "markov_head"]
    report = key_report(zlab_params(cfg), load_file(out / "model.safetensors"))
    assert (report.unknown, report.missing, report.wrong) == ([], [], [])


def test_the_cli_writes_both_layouts_and_the_gguf_converter_input(tmp_path, target):
    export, _ = export_dflash(target, tmp_path / "export")
    for fmt in ("dflash-zlab", "speculators"):
        assert main(["export", str(export), "--out", str(tmp_path / fmt), "--format", fmt]) == 0
    assert json.loads((tmp_path / "dflash-zlab" / "config.json").read_text())["architectures"] == [
        "DFlashDraftModel"
    ]
    spec = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "tiny"  # the recorded target
    converter_input(
        export, tmp_path / "in", tmp_path / "verifier"
    )  # llama.cpp converts the z-lab layout
    cfg = json.loads((tmp_path / "in" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"][
        "target_layer_ids"
    ] == [0, 1, 2]
    assert "embed_tokens.weight" not in load_file(tmp_path / "in" / "model.safetensors")
