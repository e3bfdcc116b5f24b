"""The one exportable-module base: every exported module loads as ``from_export(dir, **shared) ->
(module, config)``."""

from __future__ import annotations

import inspect
import json
from dataclasses import asdict

import pytest
import torch

from draftsmith.controllers.acceptance import AcceptanceHead
from draftsmith.controllers.adaptive_temperature import AdaptiveTemperatureHead
from draftsmith.controllers.learn2pd import Learn2PDConfig, Learn2PDFilter
from draftsmith.drafters.eagle import EagleDrafter
from draftsmith.drafters.eagle3 import Eagle3Drafter
from draftsmith.drafters.kangaroo import KangarooDrafter
from draftsmith.export.exportable import Exportable
from draftsmith.export.format import ExportError, write_export
from draftsmith.heads.clover import CloverHeads
from draftsmith.heads.hydra import HydraHeads
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads

pytestmark = pytest.mark.unit

EXPORTED = (
    MedusaHeads,
    HydraHeads,
    CloverHeads,
    EagleDrafter,
    Eagle3Drafter,
    KangarooDrafter,
    Learn2PDFilter,
    AdaptiveTemperatureHead,
    AcceptanceHead,
)
TARGET = {"name_or_path": "tiny", "vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 2}


def _export(tmp_path, module, method=None, state=None, architecture=None):
    config = {
        "method": method or type(module).method,
        "architecture": architecture or module.architecture(),
        "target": TARGET,
    }
    return write_export(
        tmp_path / "export", module.state_dict() if state is None else state, config
    )


def test_every_exported_module_has_the_one_loader():
    for cls in EXPORTED:
        assert issubclass(cls, Exportable) and isinstance(cls.method, str), cls
        assert "from_export" not in vars(cls), f"{cls.__name__} defines its own from_export"
        assert list(inspect.signature(cls.from_export).parameters) == [
            "export_dir",
            "shared_weights",
        ]


def test_round_trip_returns_the_module_and_its_config(tmp_path):
    module = Learn2PDFilter(Learn2PDConfig(block_length=4, hidden=8, num_layers=2))
    out = _export(tmp_path, module)
    loaded, config = Learn2PDFilter.from_export(out, block_length=4)
    assert isinstance(loaded, Learn2PDFilter) and not loaded.training
    assert config["method"] == "learn2pd" and config["architecture"] == asdict(module.config)
    for k, v in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)


def test_another_method_is_refused_naming_both(tmp_path):
    out = _export(
        tmp_path, MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=32, num_heads=2))
    )  # a sound export
    with pytest.raises(
        ExportError, match=r"holds a 'medusa' export, not learn2pd \(Learn2PDFilter\)"
    ):
        Learn2PDFilter.from_export(out)


def test_an_architecture_of_another_method_is_refused_as_relabelled(tmp_path):
    module = Learn2PDFilter(Learn2PDConfig(block_length=4, hidden=8, num_layers=2))
    out = _export(
        tmp_path, module, method="medusa"
    )  # config.json says medusa, its fields are learn2pd's
    with pytest.raises(
        ExportError,
        match=r"claims method 'medusa', but its architecture fields \['block_length', "
        r"'hidden', .* are unknown to MedusaConfig; if config.json's 'method' was",
    ):
        Learn2PDFilter.from_export(out)


def test_missing_and_unexpected_weights_are_named(tmp_path):
    module = Learn2PDFilter(Learn2PDConfig(block_length=4, hidden=8, num_layers=2))
    state = dict(module.state_dict())
    state.pop("layers.0.weight")
    state["stray.weight"] = torch.zeros(1)
    out = _export(tmp_path, module, state=state)
    with pytest.raises(
        ExportError, match=r"missing \['layers.0.weight'\], unexpected \['stray.weight'\]"
    ) as err:
        Learn2PDFilter.from_export(out)
    assert str(out) in str(err.value)


def test_unknown_architecture_fields_are_refused(tmp_path):
    module = Learn2PDFilter(Learn2PDConfig(block_length=4, hidden=8, num_layers=2))
    out = _export(tmp_path, module, architecture={**module.architecture(), "future_knob": 3})
    with pytest.raises(
        ExportError, match=r"architecture fields \['future_knob'\] are unknown to Learn2PDConfig"
    ):
        Learn2PDFilter.from_export(out)


def test_shared_weights_come_from_keywords_and_medusa2_exports_load(tmp_path):
    cfg = MedusaConfig(hidden_size=8, vocab_size=32, num_heads=2, share_lm_head=True)
    lm_head = torch.randn(32, 8)
    heads = MedusaHeads(cfg, lm_head)
    out = write_export(
        tmp_path / "m2",
        heads.trainable_state_dict(),
        {"method": "medusa2", "architecture": heads.architecture(), "target": TARGET},
    )
    loaded, config = MedusaHeads.from_export(out, lm_head_weight=lm_head)
    assert config["method"] == "medusa2" and torch.equal(loaded.shared_lm_head, lm_head)
    assert json.loads((out / "config.json").read_text())["architecture"] == asdict(cfg)
