"""SpecDec++ calibration: reliability bins, ECE and Brier score by hand, and ``calibrate`` writing
the reliability plot and the ECE (overall and per depth) of an acceptance head's held-out drafts,
and refusing an export that is no acceptance head."""

from __future__ import annotations

import pytest
import torch
from test_eagle_runtime import lean_from_hf
from test_specdecpp import eagle_export

from draftsmith.controllers.acceptance import AcceptanceHead, AcceptanceHeadConfig
from draftsmith.distill.target.frozen import Target
from draftsmith.export.format import write_export
from draftsmith.recipes.specdecpp import objective as specdecpp

pytestmark = pytest.mark.unit


def test_reliability_bins_and_ece_by_hand():
    from draftsmith.evals.calibrate import reliability

    report = reliability(
        torch.tensor([0.05, 0.15, 0.95, 0.95]), torch.tensor([0, 1, 1, 0]), bins=10
    )
    assert report["ece"] == pytest.approx((0.05 + 0.85 + 2 * 0.45) / 4)
    assert [b["count"] for b in report["bins"]] == [1, 1, 0, 0, 0, 0, 0, 0, 0, 2]
    assert report["brier"] == pytest.approx((0.05**2 + 0.85**2 + 0.05**2 + 0.95**2) / 4)


def test_calibrate_writes_the_plot_and_ece_of_held_out_drafts(tiny_target_dir, tmp_path):
    import json

    from draftsmith.evals.calibrate import calibrate

    tgt = Target.load(str(tiny_target_dir), dtype="fp32")
    lean = lean_from_hf(tgt.model)
    base = eagle_export(tgt, lean, tmp_path / "eagle", 0)
    head = AcceptanceHead(AcceptanceHeadConfig(64, 1))
    arch = {**head.architecture(), "base_export": specdecpp.base_reference(base)}
    config = {
        "method": "specdecpp",
        "architecture": arch,
        "target": tgt.identity(),
        "base_export": arch["base_export"],
        "inference": {
            "stop_policy": {"kind": "learned", "threshold": 0.3, "min_depth": 1, "max_depth": 3}
        },
    }
    export = write_export(tmp_path / "head", head.state_dict(), config)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello world"}\n{"prompt": "why is the answer python"}\n')
    report = calibrate(
        str(export),
        str(prompts),
        str(tmp_path / "out"),
        target=str(tiny_target_dir),
        max_new_tokens=12,
    )
    assert (tmp_path / "out/reliability.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "out/calibration.json").read_text())
    assert saved["ece"] == pytest.approx(report["ece"]) and 0 <= saved["ece"] <= 1
    assert saved["count"] == sum(b["count"] for b in saved["bins"]) > 0
    assert set(saved["by_depth"]) <= {"1", "2", "3"} and "1" in saved["by_depth"]
    with pytest.raises(ValueError, match="calibrate scores a SpecDec\\+\\+ acceptance head"):
        calibrate(str(base), str(prompts), str(tmp_path / "out2"), target=str(tiny_target_dir))
