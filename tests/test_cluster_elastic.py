"""Resume a 2-process DDP checkpoint in 1 process: the accumulation doubles to keep the global
batch, the epoch position is rescaled, and the weights match an uninterrupted run over the same
global batches.

The uninterrupted reference is 1 process with 2-step accumulation, which tests/test_train.py shows
equal to 2 DDP processes (same tolerance). Slow (one 2-process run): ``pytest -m slow
tests/test_cluster_elastic.py``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.cli.training import compose_config
from draftsmith.distill.engine.exporting import load_checkpoint
from draftsmith.distill.engine.trainer import train
from draftsmith.recipes import get_recipe

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


def overrides(target: Path, data: Path, *extra: str) -> list[str]:
    # Adam's eps keeps updates proportional to gradients (see
    # test_ddp_two_processes_match_one_process).
    return [
        "recipe=medusa",
        f"target.name_or_path={target}",
        "target.dtype=fp32",
        f"data.spec={data}",
        "data.limit=null",
        "data.max_length=48",
        "data.batch_size=2",
        "data.val_fraction=0.1",
        "trainer.log_every_n_steps=1",
        "run.checkpoint_every=2",
        "run.final_eval_batches=0",
        "optim.warmup_steps=0",
        "optim.scheduler=constant",
        "optim.grad_clip=0",
        "optim.eps=1e-3",
        "heads.num_heads=2",
        *extra,
    ]


@pytest.mark.slow
def test_ddp_checkpoint_resumes_in_one_process_with_the_same_global_batch(
    tmp_path, tiny_target_dir, tiny_data_file, caplog
):
    run_dir = tmp_path / "elastic"
    ddp = overrides(
        tiny_target_dir,
        tiny_data_file,
        "trainer=ddp",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        "trainer.max_steps=2",
        "run.export=false",
        f"hydra.run.dir={run_dir}",
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *ddp],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "HYDRA_FULL_ERROR": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert load_checkpoint(run_dir)["global_step"] == 2

    resumed_cfg = compose_config(
        overrides(tiny_target_dir, tiny_data_file, "trainer=cpu", "trainer.max_steps=4")
    )
    with caplog.at_level(logging.INFO):
        train(resumed_cfg, get_recipe("medusa"), run_dir)
    assert (
        "resuming on 1 devices (was 2): trainer.accumulate_grad_batches 1 -> 2 "
        "keeps the global batch of 4" in caplog.text
    )
    assert resumed_cfg.trainer.accumulate_grad_batches == 2
    assert load_checkpoint(run_dir)["global_step"] == 4

    straight = tmp_path / "straight"
    train(
        compose_config(
            overrides(
                tiny_target_dir,
                tiny_data_file,
                "trainer=cpu",
                "trainer.max_steps=4",
                "trainer.accumulate_grad_batches=2",
            )
        ),
        get_recipe("medusa"),
        straight,
    )
    want = load_file(straight / "export" / "model.safetensors")
    got = load_file(run_dir / "export" / "model.safetensors")
    assert want.keys() == got.keys() and want["heads.0.blocks.0.linear.weight"].abs().max() > 0
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
