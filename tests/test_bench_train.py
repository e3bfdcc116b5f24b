"""`draftsmith bench-train`: the online step, the target forward alone and the drafter-only step a feature cache
trains with; the drafter-only step scores exactly the loss the online step scores on the same batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftsmith.cli.training import compose_config
from draftsmith.distill.engine.bench_train import _cached_features, _with_teacher, bench_train, sample_batches
from draftsmith.distill.engine.module import DistillModule
from draftsmith.distill.target.frozen import Target
from draftsmith.recipes import get_recipe

pytestmark = pytest.mark.unit


def overrides(target_dir: Path, data_file: Path) -> list[str]:
    return ["recipe=eagle3", f"target.name_or_path={target_dir}", "target.dtype=fp32", f"data.spec={data_file}",
            "data.limit=null", "data.max_length=48", "data.batch_size=4", "data.val_fraction=0.1",
            "drafter.target_layers=[1,2,3]", "drafter.draft_vocab_size=40"]


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
    online, _ = module._step(batch)
    cached, _ = objective.loss(batch, _with_teacher(target, objective, _cached_features(target, objective, batch)))
    assert torch.isfinite(online)
    torch.testing.assert_close(cached, online)


def test_bench_train_reports_the_cache_speedup_next_to_the_online_rates(tiny_target_dir, tiny_data_file):
    cfg = compose_config(overrides(tiny_target_dir, tiny_data_file))
    result = bench_train(cfg, get_recipe("eagle3"), steps=2, warmup=1)
    for key in ("target_forward_tokens_per_s", "train_tokens_per_s", "drafter_only_tokens_per_s"):
        assert result[key] > 0
    assert result["cache_speedup"] == pytest.approx(
        result["drafter_only_tokens_per_s"] / result["train_tokens_per_s"], rel=0.05)
