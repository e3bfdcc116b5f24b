"""DFlash exports: the z-lab layout, vLLM's speculators ``dflash`` type and llama.cpp's GGUF,
against the engines.

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
from conftest import build_tiny_llama
from recipe_configs import recipe_config
from safetensors.torch import load_file

from draftsmith.cli import main
from draftsmith.cli.exporting import _convert
from draftsmith.distill.engine.exporting import export_from_module
from draftsmith.distill.target.frozen import Target
from draftsmith.export.dflash import to_zlab, zlab_layer_ids
from draftsmith.export.format import ExportError, read_export
from draftsmith.export.gguf import converter_input
from draftsmith.export.speculators import to_speculators
from draftsmith.export.speculators_dflash import speculators_aux_ids, to_speculators_dflash
from draftsmith.recipes.dflash.build import build_objective

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
TAPS = [1, 2, 3]  # hidden_states indices of the 4-layer tiny target


@pytest.fixture()
def target(tiny_tokenizer) -> Target:
    return Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")


def export_dflash(
    target: Target,
    out: Path,
    layers: list[int] | None = TAPS,
    block: int = 4,
    heads: bool = False,
    num_layers: int = 2,
    norms: bool = True,
) -> tuple[Path, object]:
    """A DFlash export of random weights for ``target`` (every weight perturbed, so equality tests
    can fail; ``norms=False`` keeps the RMSNorm weights at 1, which makes the drafts depend on the
    context taps).
    """
    torch.manual_seed(0)
    cfg = recipe_config(
        "dflash",
        {
            "drafter": {
                "target_layers": layers,
                "block_size": block,
                "num_layers": num_layers,
                "confidence_head": heads,
                "markov_head": heads,
                "mask_token_id": None,
            }
        },
    )
    g = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randint(4, target.vocab_size, (2, 30), generator=g),
            torch.ones(2, 30, dtype=torch.long),
        )
    ]
    objective = build_objective(cfg, target, batches)
    for p in objective.module.parameters():
        if norms or p.dim() > 1:
            p.data.normal_(0, 0.1)
    module = SimpleNamespace(
        drafter=objective.module, objective=objective, run_info={"target": target.identity()}
    )
    return export_from_module(module, out, training={}), objective.module


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
    assert (
        vllm_dflash_ids == zlab and [i + 1 for i in vllm_dflash_ids] == taps
    )  # captured at input of id + 1
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
    # to_speculators delegates a DFlash export to export/speculators_dflash.py
    out = to_speculators(export, tmp_path / "spec", "org/tiny")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    raw = json.loads((out / "config.json").read_text())
    assert (
        raw["speculators_model_type"] == "dflash"
        and raw["speculators_config"]["algorithm"] == "dflash"
    )
    assert (
        raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    )  # block_size - 1
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
