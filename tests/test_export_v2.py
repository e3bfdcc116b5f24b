"""Export format v2: named weight parts, an identity that includes an adapter, a checked base-export
reference."""

import json

import pytest
import torch

from draftsmith.export.format import (
    ExportError,
    TargetMismatchError,
    read_export,
    read_export_parts,
    write_export,
)
from draftsmith.export.stacking import base_reference, resolve_base_export
from draftsmith.export.target_check import check_target

pytestmark = pytest.mark.unit

TARGET = {
    "name_or_path": "t",
    "vocab_size": 10,
    "hidden_size": 4,
    "num_hidden_layers": 2,
    "fingerprint": "sha256:ab",
}


def config(**extra):
    return {"method": "medusa", "architecture": {"num_heads": 1}, "target": dict(TARGET), **extra}


def test_parts_round_trip_and_the_main_part_stays_model_safetensors(tmp_path):
    heads, adapter = {"w": torch.ones(2, 2)}, {"lora_A": torch.zeros(3)}
    out = write_export(tmp_path / "e", heads, config(), parts={"adapter": adapter})
    cfg, parts = read_export_parts(out)
    assert cfg["format_version"] == 2 and set(parts) == {"model", "adapter"}
    assert cfg["parts"]["adapter"] == {"file": "adapter.safetensors", "tensors": 1}
    assert torch.equal(parts["adapter"]["lora_A"], adapter["lora_A"]) and torch.equal(
        read_export(out)[1]["w"], heads["w"]
    )
    with pytest.raises(ValueError, match="lower-case letters"):
        write_export(tmp_path / "bad", heads, config(), parts={"Bad Name": adapter})


def test_a_v1_export_still_loads(tmp_path):
    out = write_export(tmp_path / "e", {"w": torch.ones(1)}, config())
    cfg = json.loads((out / "config.json").read_text())
    cfg["format_version"] = 1
    del cfg["parts"]
    (out / "config.json").write_text(json.dumps(cfg))
    loaded, parts = read_export_parts(out)
    assert loaded["format_version"] == 1 and list(parts) == ["model"]


def test_an_export_that_changes_its_target_is_refused_against_the_bare_base(tmp_path):
    medusa2 = config(target={**TARGET, "adapter": {"kind": "lora", "fingerprint": "sha256:feed"}})
    with pytest.raises(TargetMismatchError, match="changes its target .*lora.*adapter"):
        check_target(medusa2, dict(TARGET))
    check_target(
        medusa2, {**TARGET, "adapter": {"fingerprint": "sha256:feed"}}
    )  # with the adapter applied: fine
    check_target(config(), dict(TARGET))


def test_a_stacked_export_checks_its_base(tmp_path):
    base = write_export(tmp_path / "medusa", {"w": torch.ones(2)}, config())
    stacked = config(method="specdecpp", base_export=base_reference(base))
    assert resolve_base_export(stacked) == base and resolve_base_export(config()) is None
    moved = tmp_path / "moved"
    base.rename(moved)
    with pytest.raises(ExportError, match="does not exist here; pass its new location"):
        resolve_base_export(stacked)
    assert resolve_base_export(stacked, moved) == moved
    write_export(moved, {"w": torch.zeros(2)}, config())  # retrained in place: different weights
    with pytest.raises(
        ExportError, match="is not the medusa export this specdecpp export was trained on"
    ):
        resolve_base_export(stacked, moved)
