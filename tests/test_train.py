"""End-to-end training through train.py / Hydra on a tiny in-process target: config errors, export,
resume, NaN, DDP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.distill.engine.exporting import export_from_checkpoint, load_checkpoint
from draftsmith.export.format import read_export

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


def run_train(*overrides: str, timeout: int = 240, check: bool = True, env: dict | None = None):
    """Run ``python train.py`` in a subprocess (as a user would) and return the completed
    process."""
    cmd = [sys.executable, str(ROOT / "train.py"), *overrides]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def tiny_overrides(target: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    """The tiny run's overrides; a key in ``extra`` replaces the default one (train.py refuses a key
    given twice)."""
    # `target=PATH` and `data=PATH` are shorthands for target.name_or_path / data.spec.
    base = [
        "recipe=medusa",
        f"target={target}",
        "target.dtype=fp32",
        f"data={data}",
        "data.limit=null",
        "data.max_length=48",
        "data.batch_size=4",
        "data.val_fraction=0.1",
        "trainer.max_steps=6",
        "trainer.log_every_n_steps=1",
        "run.checkpoint_every=3",
        "run.final_eval_batches=2",
        "optim.warmup_steps=0",
        f"hydra.run.dir={run_dir}",
    ]
    replaced = {override_key(e) for e in extra}
    return [o for o in base if override_key(o) not in replaced] + list(extra)


def test_recipe_is_mandatory_and_unknown_recipes_are_listed():
    proc = run_train(check=False)
    assert proc.returncode == 1 and proc.stderr.startswith(
        "error: no recipe: pick one with recipe=NAME ("
    )
    assert "medusa" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    proc = run_train("recipe=doesnotexist", check=False)
    assert proc.returncode == 1
    assert (
        proc.stderr.startswith("error: unknown recipe 'doesnotexist'; valid recipes: ")
        and "medusa" in proc.stderr
    )


def test_unknown_option_and_missing_field_fail_before_loading_the_target(tmp_path):
    proc = run_train("recipe=medusa", "heads.nonexistent=3", check=False)
    assert proc.returncode != 0 and "heads.nonexistent" in proc.stderr
    # A required field left missing must fail fast, before any model is loaded.
    proc = run_train(
        "recipe=medusa", "target.name_or_path=???", f"hydra.run.dir={tmp_path}", check=False
    )
    assert proc.returncode != 0 and "target.name_or_path" in proc.stderr
    assert "Loading weights" not in proc.stderr


def test_cfg_job_prints_the_composed_config():
    proc = run_train("recipe=medusa", "heads.num_heads=5", "--cfg", "job")
    assert "num_heads: 5" in proc.stdout and "name: medusa" in proc.stdout
    proc = run_train(
        "recipe=medusa", "target=/models/my-llama", "data=/data/chats.jsonl", "--cfg", "job"
    )
    assert (
        "name_or_path: /models/my-llama" in proc.stdout and "spec: /data/chats.jsonl" in proc.stdout
    )
    proc = run_train(
        "recipe=medusa", "target=smollm2", "--cfg", "job"
    )  # a group option stays a group choice
    assert "name_or_path: smollm2-135m" in proc.stdout


def check_cli_exports(run_dir: Path, out_root: Path) -> None:
    """The console command exports a run folder, converts an export to the engine layout, and
    refuses a folder with nothing to export."""
    from draftsmith.cli import main as cli_main

    assert cli_main(["export", str(run_dir), "--out", str(out_root / "cli_export")]) == 0
    assert read_export(out_root / "cli_export")[0]["method"] == "medusa"
    assert (
        cli_main(
            [
                "export",
                str(run_dir / "export"),
                "--out",
                str(out_root / "vllm"),
                "--format",
                "medusa",
            ]
        )
        == 0
    )
    assert json.loads((out_root / "vllm" / "config.json").read_text())["model_type"] == "medusa"
    assert cli_main(["export", str(out_root / "nothing"), "--out", str(out_root / "x")]) == 2


def kill_once_checkpointed(overrides: list[str], run_dir: Path) -> Path:
    """Start ``train.py`` and kill -9 it once it has written a checkpoint (a simulated crash);
    return the path of its last.ckpt."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *overrides],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    last = run_dir / "checkpoints" / "last.ckpt"
    deadline = time.time() + 180
    while time.time() < deadline and not last.exists():
        time.sleep(0.5)
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return last


def test_train_exports_and_the_checkpoint_and_cli_export_the_same(
    tmp_path, tiny_target_dir, tiny_data_file
):
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_target_dir, tiny_data_file, run_dir)
    run_train(*overrides)
    config, state = read_export(run_dir / "export")
    assert config["method"] == "medusa" and config["training"]["steps"] == 6
    assert config["architecture"]["num_heads"] == 3 and config["target"]["vocab_size"] > 0
    metrics = (run_dir / "logs" / "metrics.csv").read_text()
    assert "train/head0/top1" in metrics and "val/loss" in metrics
    ckpt = load_checkpoint(run_dir)
    assert ckpt["global_step"] == 6
    assert not any(k.startswith("_target") or ".model." in k for k in ckpt["state_dict"]), (
        "target leaked into ckpt"
    )
    # Exporting the checkpoint reproduces the end-of-training export exactly.
    again = export_from_checkpoint(run_dir, tmp_path / "from_ckpt")
    _, state2 = read_export(again)
    assert state.keys() == state2.keys() and all(torch.equal(state[k], state2[k]) for k in state)
    check_cli_exports(run_dir, tmp_path)


def test_train_resumes_after_kill(tmp_path, tiny_target_dir, tiny_data_file):
    """kill -9 a longer run once it has written a checkpoint, then re-run the same command: it
    resumes from the checkpoint's step."""
    crash_dir = tmp_path / "crash"
    longer = tiny_overrides(
        tiny_target_dir,
        tiny_data_file,
        crash_dir,
        "trainer.max_steps=400",
        "run.checkpoint_every=2",
    )
    last = kill_once_checkpointed(longer, crash_dir)
    assert last.exists(), "no checkpoint written before the kill"
    saved_step = load_checkpoint(crash_dir)["global_step"]
    assert 0 < saved_step < 400
    resumed = run_train(
        *longer[:-2], f"trainer.max_steps={saved_step + 4}", "run.checkpoint_every=2"
    )
    summary = json.loads(resumed.stdout[resumed.stdout.index("{") :])
    assert summary["steps"] == saved_step + 4
    assert load_checkpoint(crash_dir)["global_step"] == saved_step + 4


def test_resumed_run_continues_the_epoch_and_matches_an_uninterrupted_one(
    tmp_path, tiny_target_dir, tiny_data_file
):
    """Stop after 3 of the epoch's ~14 batches, resume to 6 steps: the same batches, so the same
    weights, as one 6-step run (a run that replayed the epoch's first batches would end
    elsewhere)."""
    common = ("optim.scheduler=constant", "run.checkpoint_every=3", "run.val_every=0")
    straight = tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "straight", *common)
    run_train(*straight)
    split = tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "split", *common)
    run_train(
        *tiny_overrides(
            tiny_target_dir, tiny_data_file, tmp_path / "split", *common, "trainer.max_steps=3"
        )
    )
    assert load_checkpoint(tmp_path / "split")["loops"]["fit_loop"]["state_dict"][
        "combined_loader"
    ] == [{"batches_done_in_epoch": 3}]
    run_train(*split)  # the same command again: resumes from last.ckpt at step 3
    _, want = read_export(tmp_path / "straight" / "export")
    _, got = read_export(tmp_path / "split" / "export")
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_nan_loss_stops_with_clear_message_and_keeps_checkpoint(
    tmp_path, tiny_target_dir, tiny_data_file
):
    run_dir = tmp_path / "nan"
    overrides = tiny_overrides(
        tiny_target_dir,
        tiny_data_file,
        run_dir,
        "optim.lr=1e30",
        "optim.grad_clip=0",
        "trainer.max_steps=40",
        "run.checkpoint_every=1",
    )
    proc = run_train(*overrides, check=False)
    assert proc.returncode != 0
    assert "loss is nan" in proc.stderr.lower() or "loss is inf" in proc.stderr.lower(), (
        proc.stderr[-2000:]
    )
    ckpt = load_checkpoint(run_dir)
    assert all(
        torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point()
    )
    assert not (run_dir / "export").exists()


def test_multirun_sweep(tmp_path, tiny_target_dir, tiny_data_file):
    base = [
        o
        for o in tiny_overrides(
            tiny_target_dir, tiny_data_file, tmp_path / "unused", "trainer.max_steps=2"
        )
        if not o.startswith("hydra.run.dir")
    ]
    run_train("-m", *base, "heads.num_heads=1,2", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    exports = sorted((tmp_path / "sweep").glob("*/export/config.json"))
    assert len(exports) == 2
    assert sorted(json.loads(p.read_text())["architecture"]["num_heads"] for p in exports) == [1, 2]


def test_ddp_two_processes_match_one_process(tmp_path, tiny_target_dir, tiny_data_file):
    """2 CPU processes (gloo) x batch 2 == 1 process x batch 2 with 2-step accumulation over the
    same batches."""
    # Adam turns float-noise gradients (~1e-9) into full +-lr steps; a large eps keeps updates
    # proportional to the gradient so the comparison measures the data-parallel maths, not Adam's
    # sign of noise.
    common = [
        "data.batch_size=2",
        "trainer.max_steps=3",
        "run.checkpoint_every=100",
        "optim.grad_clip=0",
        "optim.eps=1e-3",
        "run.final_eval_batches=0",
    ]
    single = tmp_path / "single"
    run_train(
        *tiny_overrides(
            tiny_target_dir, tiny_data_file, single, *common, "trainer.accumulate_grad_batches=2"
        )
    )
    ddp = tmp_path / "ddp"
    run_train(
        *tiny_overrides(
            tiny_target_dir,
            tiny_data_file,
            ddp,
            *common,
            "trainer=ddp",
            "trainer.devices=2",
            "trainer.accelerator=cpu",
        ),
        timeout=400,
    )
    a = load_file(single / "export" / "model.safetensors")
    b = load_file(ddp / "export" / "model.safetensors")
    assert a.keys() == b.keys()
    # The zero-initialised ResBlock weights must have moved, or equality would prove nothing.
    assert a["heads.0.blocks.0.linear.weight"].abs().max() > 0
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4), (k, (a[k] - b[k]).abs().max())


def test_wandb_logger_runs_offline(tmp_path, tiny_target_dir, tiny_data_file):
    run_dir = tmp_path / "wb"
    run_train(
        *tiny_overrides(
            tiny_target_dir, tiny_data_file, run_dir, "trainer.max_steps=2", "logger=wandb"
        ),
        env={"WANDB_MODE": "", "WANDB_SILENT": "true"},
    )
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb must default to offline mode"
    assert (run_dir / "logs" / "metrics.csv").is_file(), "CSV logging stays on next to wandb"
