"""``draftsmith import``: speculators eagle3 checkpoints into draftsmith exports
(export/speculators_import.py).

Round trip: our EAGLE-3 export -> ``--format speculators`` -> ``draftsmith import`` gives the same
weights, the same architecture, inference depth and target, and the runtime serves the same tokens
with the same acceptance per step. The real trainer's checkpoints are imported in
tests/test_peer_speculators.py (its venv).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_llama
from safetensors.torch import load_file, save_file
from test_speculators_export import export_eagle3

from draftsmith.cli import main
from draftsmith.distill.target.frozen import Target
from draftsmith.export.format import ExportError, TargetMismatchError, read_export
from draftsmith.export.speculators import to_speculators
from draftsmith.export.speculators_import import import_speculators
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.registry import build_proposer
from draftsmith.runtime.target.model import LeanDecoder, ModelConfig

pytestmark = pytest.mark.unit

PROMPTS = [[5, 9, 13, 40], [30, 31, 32, 33, 34, 35, 100, 101, 8]]


@pytest.fixture()
def target(tiny_tokenizer, tiny_target_dir) -> Target:
    """The model saved in ``tiny_target_dir`` (same seed), named by that folder."""
    return Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, str(tiny_target_dir))


def lean(target: Target) -> LeanDecoder:
    weights = {k: v.detach().clone() for k, v in target.model.state_dict().items()}
    return LeanDecoder(
        ModelConfig.from_hf_dict(target.model.config.to_dict()), weights, kernel_backend="torch"
    ).eval()


def served(export: Path, decoder: LeanDecoder) -> list[tuple[list[int], list[int]]]:
    """(tokens, accepted per step) of every prompt, chain of depth 3 (the same drafts give the same
    acceptances)."""
    dec = SpeculativeDecoder(decoder, build_proposer(export, decoder, policy="chain", depth=3))
    return [(r.tokens, r.accepted_per_step) for r in (dec.generate(p, 24) for p in PROMPTS)]


@pytest.mark.parametrize("draft_vocab", [48, 0])
def test_round_trip_through_the_speculators_format_is_exact(
    tmp_path, target, tiny_target_dir, draft_vocab
):
    export, _ = export_eagle3(target, tmp_path / "export", draft_vocab=draft_vocab)
    spec = to_speculators(export, tmp_path / "spec", str(tiny_target_dir))
    # the recorded verifier is the target folder: no --target needed
    assert main(["import", str(spec), "--out", str(tmp_path / "imported")]) == 0
    ours, ours_state = read_export(export)
    back, back_state = read_export(tmp_path / "imported")
    assert back["method"] == "eagle3" and dict(back["architecture"]) == dict(ours["architecture"])
    # depth = speculative_tokens - 1 and the recipe's tree
    assert back["inference"] == ours["inference"]
    assert {
        k: back["target"][k] for k in ("fingerprint", "lm_head", "vocab_size", "hidden_size")
    } == {k: ours["target"][k] for k in ("fingerprint", "lm_head", "vocab_size", "hidden_size")}
    assert sorted(back_state) == sorted(ours_state)
    for key, value in ours_state.items():
        assert torch.equal(back_state[key], value), key
    assert back["training"]["imported_from"]["format"] == "speculators"
    decoder = lean(target)
    assert served(tmp_path / "imported", decoder) == served(export, decoder)


def test_bf16_checkpoint_widens_exactly(tmp_path, target, tiny_target_dir):
    export, _ = export_eagle3(target, tmp_path / "export")
    spec = to_speculators(export, tmp_path / "spec", str(tiny_target_dir), dtype="bfloat16")
    out = import_speculators(spec, tmp_path / "imported", target.identity(), target.embed_weight)
    _, state = read_export(out)
    _, ours = read_export(export)
    assert state["fc.weight"].dtype == torch.float32
    assert torch.equal(state["fc.weight"], ours["fc.weight"].to(torch.bfloat16).float())


def _edit(spec: Path, config_edit=None, tensor_edit=None) -> Path:
    if config_edit:
        config = json.loads((spec / "config.json").read_text())
        config_edit(config)
        (spec / "config.json").write_text(json.dumps(config))
    if tensor_edit:
        tensors = load_file(spec / "model.safetensors")
        tensor_edit(tensors)
        save_file(tensors, str(spec / "model.safetensors"))
    return spec


def test_wrong_target_and_unsupported_layers_are_refused_in_one_line(
    tmp_path, target, tiny_target_dir, tiny_tokenizer
):
    export, _ = export_eagle3(target, tmp_path / "export")
    spec = to_speculators(export, tmp_path / "spec", str(tiny_target_dir))
    narrow = tmp_path / "narrow"
    build_tiny_llama(len(tiny_tokenizer), hidden_size=32).save_pretrained(narrow)
    tiny_tokenizer.save_pretrained(narrow)
    assert main(["import", str(spec), "--out", str(tmp_path / "x"), "--target", str(narrow)]) == 2
    with pytest.raises(TargetMismatchError, match="hidden_size: checkpoint has 64, target has 32"):
        import_speculators(
            spec,
            tmp_path / "x",
            Target(
                build_tiny_llama(len(tiny_tokenizer), hidden_size=32), tiny_tokenizer, "narrow"
            ).identity(),
        )
    other = Target(
        build_tiny_llama(len(tiny_tokenizer), seed=1), tiny_tokenizer, "other"
    )  # same sizes
    with pytest.raises(
        TargetMismatchError, match="embed_tokens.weight is not the target's embedding"
    ):
        import_speculators(spec, tmp_path / "x", other.identity(), other.embed_weight)
    shallow = Target(
        build_tiny_llama(len(tiny_tokenizer), num_hidden_layers=3), tiny_tokenizer, "shallow"
    )
    with pytest.raises(TargetMismatchError, match=r"aux hidden-state ids \[3\]"):
        import_speculators(spec, tmp_path / "x", shallow.identity())
    _edit(spec, lambda c: c.update(norm_before_residual=True, norm_output=True))
    with pytest.raises(
        ExportError, match="norm_before_residual=true .*--no-norm-before-residual.*norm_output"
    ):
        import_speculators(spec, tmp_path / "x", target.identity())
    _edit(
        spec,
        lambda c: c.update(norm_before_residual=False, norm_output=False),
        lambda t: t.update(d2t=torch.roll(t["d2t"], 1)),
    )
    with pytest.raises(ExportError, match="d2t and t2d disagree"):
        import_speculators(spec, tmp_path / "x", target.identity())
    assert not (tmp_path / "x").exists()


def test_other_speculators_types_and_missing_files_are_refused(tmp_path, target):
    (tmp_path / "d").mkdir()
    with pytest.raises(ExportError, match="needs config.json and model.safetensors"):
        import_speculators(tmp_path / "d", tmp_path / "x", target.identity())
    (tmp_path / "d" / "config.json").write_text(json.dumps({"speculators_model_type": "dflash"}))
    save_file({"fc.weight": torch.zeros(1)}, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ExportError, match="'dflash' checkpoint; draftsmith imports eagle3"):
        import_speculators(tmp_path / "d", tmp_path / "x", target.identity())


@pytest.mark.parametrize(
    "changes,names",
    [
        (
            {"intermediate_size": 96},
            (
                "intermediate_size give layer.mlp.gate_proj.weight the shape [96, 64], the weights "
                "hold [128, 64]"
            ),
        ),
        (
            {"num_attention_heads": 8, "head_dim": None},
            "num_key_value_heads x head_dim give layer.self_attn.k_proj",
        ),
    ],
)
def test_a_config_that_disagrees_with_its_weights_is_refused(
    tmp_path, target, tiny_target_dir, changes, names
):
    """It was imported, and the export stamped with a fresh identity its weights do not have."""
    export, _ = export_eagle3(target, tmp_path / "export")
    spec = to_speculators(export, tmp_path / "spec", str(tiny_target_dir))

    def edit(config):
        for key, value in changes.items():
            if value is None:
                config["transformer_layer_config"].pop(key, None)
            else:
                config["transformer_layer_config"][key] = value

    _edit(spec, edit)
    with pytest.raises(
        ExportError,
        match="config.json and model.safetensors disagree: "
        + names.replace("[", r"\[").replace("]", r"\]"),
    ):
        import_speculators(spec, tmp_path / "x", target.identity(), target.embed_weight)
    assert not (tmp_path / "x").exists()


def test_nan_weights_and_mistyped_configs_are_refused(tmp_path, target, tiny_target_dir):
    export, _ = export_eagle3(target, tmp_path / "export")
    spec = to_speculators(export, tmp_path / "spec", str(tiny_target_dir))
    _edit(spec, lambda c: c.update(transformer_layer_config=[1]))
    with pytest.raises(ExportError, match="transformer_layer_config must be an object"):
        import_speculators(spec, tmp_path / "x", target.identity())
    spec = to_speculators(export, tmp_path / "spec2", str(tiny_target_dir))
    _edit(spec, tensor_edit=lambda t: t.update({"fc.weight": t["fc.weight"] * float("nan")}))
    with pytest.raises(ExportError, match="fc.weight holds .* NaN/inf values"):
        import_speculators(spec, tmp_path / "x", target.identity())
