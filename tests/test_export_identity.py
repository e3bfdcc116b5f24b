"""An export's identity is checked as one unit (issue 40): method, architecture keys and weight
names and shapes hash to the digest recorded at export, so a `method` edited to another method with
the same weights layout is refused when loaded, while exports written before the digest keep
loading; a missing architecture key (an export edited to `kangaroo`) is one line naming the export,
the key and the fix, not `error: 'exit_layer'`."""

from __future__ import annotations

import json

import pytest
from export_faults import cli_error_line, relabel
from safetensors.torch import load_file, save_file

from draftsmith.export.format import (
    ExportSchemaError,
    MissingArchitectureKey,
    read_config,
    read_export,
)
from draftsmith.export.integrity_check import ExportIdentityError
from draftsmith.heads.medusa import MedusaHeads

pytestmark = pytest.mark.unit

FAST = ["--dtype", "fp32", "--max-new-tokens", "2", "--prompt", "hi"]


def lm_head(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir).lm_head.weight.detach()


def test_every_export_records_its_identity(medusa_export):
    identity = read_config(medusa_export)["identity"]
    assert identity["method"] == "medusa" and identity["digest"].startswith("sha256:")


def test_a_method_edited_to_one_with_the_same_layout_is_refused_when_loaded(
    tmp_path, medusa_export, tiny_target_dir
):
    edited = relabel(
        medusa_export, tmp_path / "edited", "medusa2"
    )  # MedusaHeads loads both: the layout fits
    with pytest.raises(ExportIdentityError) as err:
        MedusaHeads.from_export(edited, lm_head_weight=lm_head(tiny_target_dir))
    assert (
        str(err.value)
        == f"{edited} was written as a 'medusa' export, but its config.json now says method "
        "'medusa2' (method, architecture and weights are checked as one): restore "
        '"method": "medusa" in config.json, or re-export the drafter'
    )
    with pytest.raises(ExportIdentityError):  # the converters read through the same check
        read_export(edited)


def test_the_cli_refuses_the_relabelled_export_in_one_line(
    capsys, tmp_path, medusa_export, tiny_target_dir
):
    edited = relabel(medusa_export, tmp_path / "edited", "medusa2")
    line = cli_error_line(
        capsys, ["generate", "--drafter", str(edited), "--target", str(tiny_target_dir), *FAST]
    )
    assert (
        f"{edited} was written as a 'medusa' export" in line
        and 'restore "method": "medusa"' in line
    )


def test_an_export_edited_to_kangaroo_names_the_export_the_key_and_the_fix(
    capsys, tmp_path, medusa_export, tiny_target_dir
):
    edited = relabel(medusa_export, tmp_path / "edited", "kangaroo")
    line = cli_error_line(
        capsys, ["generate", "--drafter", str(edited), "--target", str(tiny_target_dir), *FAST]
    )
    assert line != "draftsmith generate: error: 'exit_layer'"
    # the export schema meets the medusa keys first (every reader checks it): the export, the keys,
    # the fix
    assert f"{edited} claims method 'kangaroo', but its architecture fields [" in line
    assert "'num_heads'" in line and "unknown to KangarooConfig" in line
    assert "it was written as a 'medusa' export" in line and 'restore "method": "medusa"' in line


def test_an_older_export_edited_to_kangaroo_still_gets_one_line(
    capsys, tmp_path, medusa_export, tiny_target_dir
):
    edited = relabel(medusa_export, tmp_path / "edited", "kangaroo", drop_identity=True)
    line = cli_error_line(
        capsys, ["generate", "--drafter", str(edited), "--target", str(tiny_target_dir), *FAST]
    )
    assert "unknown to KangarooConfig" in line and "'num_heads'" in line
    assert "restore the method the export was written with" in line
    kept = relabel(medusa_export, tmp_path / "kept", "medusa", drop_identity=True)
    with pytest.raises(KeyError):  # a missing key is still a KeyError for code that catches one
        read_config(kept)["architecture"]["exit_layer"]
    assert isinstance(MissingArchitectureKey("x"), KeyError)


def test_exports_written_before_the_identity_keep_loading(tmp_path, medusa_export, tiny_target_dir):
    older = relabel(medusa_export, tmp_path / "older", "medusa", drop_identity=True)
    heads, config = MedusaHeads.from_export(older, lm_head_weight=lm_head(tiny_target_dir))
    assert config["method"] == "medusa" and "identity" not in config


def test_weights_whose_names_or_shapes_changed_are_refused(tmp_path, medusa_export):
    edited = relabel(medusa_export, tmp_path / "edited", "medusa")
    state = load_file(str(edited / "model.safetensors"))
    name = sorted(state)[0]
    state[name] = state[name].reshape(-1)[:-1].clone()  # one tensor one value short
    save_file(state, str(edited / "model.safetensors"))
    with pytest.raises(ExportIdentityError, match="weight names and shapes changed after export"):
        read_export(edited)


def test_an_architecture_key_added_by_hand_is_refused(tmp_path, medusa_export):
    edited = relabel(medusa_export, tmp_path / "edited", "medusa")
    config = json.loads((edited / "config.json").read_text())
    config["architecture"]["note"] = "added by hand"
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportSchemaError, match=r"fields \['note'\] are unknown to MedusaConfig"):
        read_export(
            edited
        )  # the export schema refuses it on every read, naming the key (before the identity check)
