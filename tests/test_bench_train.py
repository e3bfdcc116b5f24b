"""`draftsmith bench-train`: the online step, the target forward alone and the drafter-only step a
feature cache trains with, each against the measured matmul rate; the drafter-only step scores
exactly the loss the online step scores on the same batch; the host cost of the step with compute
made negligible."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftsmith.cli.training import compose_config
from draftsmith.distill.engine.bench_parts import (
    count_flops,
    count_ops,
    markdown_table,
    matmul_rate,
    parts_rate,
)
from draftsmith.distill.engine.bench_train import (
    _cached_features,
    _with_teacher,
    bench_train,
    sample_batches,
)
from draftsmith.distill.engine.module import DistillModule
from draftsmith.distill.target.frozen import Target
from draftsmith.recipes import get_recipe

pytestmark = pytest.mark.unit


def overrides(target_dir: Path, data_file: Path) -> list[str]:
    return [
        "recipe=eagle3",
        f"target.name_or_path={target_dir}",
        "target.dtype=fp32",
        f"data.spec={data_file}",
        "data.limit=null",
        "data.max_length=48",
        "data.batch_size=4",
        "data.val_fraction=0.1",
        "drafter.target_layers=[1,2,3]",
        "drafter.draft_vocab_size=40",
        "trainer.precision=32-true",
    ]


@pytest.fixture(autouse=True)
def _data_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path_factory.getbasetemp() / "draftsmith-cache"))


def test_the_drafter_only_step_scores_the_online_loss(tiny_target_dir, tiny_data_file):
    cfg = compose_config(overrides(tiny_target_dir, tiny_data_file))
    target = Target.load(str(tiny_target_dir), "fp32")
    torch.manual_seed(0)
    objective = get_recipe("eagle3").build(cfg, target)
    module = DistillModule(objective, target, dict(cfg.optim), total_steps=4)
    batch = sample_batches(target, cfg, 1)[0]
    assert batch["input_ids"].shape == (4, 48) and "document_ids" in batch  # fixed packed rows
    online, _ = module._step(batch)
    cached, _ = objective.loss(
        batch, _with_teacher(target, objective, _cached_features(target, objective, batch))
    )
    assert torch.isfinite(online)
    torch.testing.assert_close(cached, online)


def test_the_yardsticks_count_what_runs():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert count_flops(lambda: a @ b) == 2 * 8 * 16 * 4
    assert count_ops(lambda: (a @ b).relu().t()) == {"ops": 3, "launching_ops": 2}  # t() is a view
    assert matmul_rate(torch.float32, "cpu", 64, 64, 64, repeats=2) > 1e6
    assert parts_rate(300.0, 600.0) == pytest.approx(200.0)


def test_bench_train_reports_rates_utilization_parts_and_host_cost(tiny_target_dir, tiny_data_file):
    cfg = compose_config(overrides(tiny_target_dir, tiny_data_file))
    result = bench_train(cfg, get_recipe("eagle3"), steps=2, warmup=1)
    for part in ("target_forward", "train", "drafter_only"):
        assert result[f"{part}_tokens_per_s"] > 0 and 0 < result[f"{part}_utilization"]
        assert result[f"{part}_gflop_per_token"] > 0
    assert result["train_gflop_per_token"] == pytest.approx(
        result["target_forward_gflop_per_token"] + result["drafter_only_gflop_per_token"], abs=2e-4
    )
    assert result["cache_speedup"] == pytest.approx(
        result["drafter_only_tokens_per_s"] / result["train_tokens_per_s"], rel=0.05
    )
    assert result["online_vs_parts"] == pytest.approx(
        result["train_tokens_per_s"]
        / parts_rate(result["target_forward_tokens_per_s"], result["drafter_only_tokens_per_s"]),
        rel=1e-3,
    )
    assert result["precision"] == "32-true" and result["matmul_gflops"] > 0
    assert [row["layers"] for row in result["host"]] == [2, 4]
    assert all(row["ms_per_step"] > 0 and row["launching_ops"] > 100 for row in result["host"])
    assert result["host"][1]["ops"] > result["host"][0]["ops"]  # two more layers issue more ops
    table = markdown_table(result)
    assert (
        "| online step |" in table
        and "online step vs its parts" in table
        and "| 4 layers, hidden 64" in table
    )


@pytest.mark.parametrize("flag", [["--steps", "0"], ["--warmup", "-1"]])
def test_bench_train_refuses_a_count_out_of_range_in_one_line(flag, capsys):
    from draftsmith.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["bench-train", "recipe=medusa", *flag])
    assert stop.value.code == 2 and flag[0] in capsys.readouterr().err


def test_bench_train_never_writes_over_a_file_or_folder_it_did_not_write(tmp_path, capsys):
    """``--out`` is checked before any work: a user's file is kept byte for byte, a folder is
    refused, in one line."""
    from draftsmith.cli import main

    mine = tmp_path / "notes.json"
    mine.write_text("my notes\n")
    assert main(["bench-train", "recipe=medusa", "--out", str(mine)]) == 1
    err = capsys.readouterr().err
    assert (
        mine.read_text() == "my notes\n"
        and f"error: --out {mine} exists and was not written by draftsmith" in err
    )
    assert main(["bench-train", "recipe=medusa", "--out", str(tmp_path)]) == 1
    assert "is a folder" in capsys.readouterr().err
