"""What guards a training run's setup and its reports: target dtype auto, CUDA-only presets on CPU,
exact teacher logits, EAGLE-1 noise and clipping, the wall-clock budget, empty data and the step
progress bar (the non-finite-loss
message: test_training_scores_nothing.py) (train.py's one-line errors: test_train_errors.py)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import build_tiny_llama
from omegaconf import OmegaConf
from recipe_configs import recipe_config

from draftsmith.cli.training import compose_config
from draftsmith.distill.target.frozen import FeatureTaps, Target
from draftsmith.kernels import cpu_caps

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
AVX2 = cpu_caps.CpuCaps(
    "x86_64", frozenset({"avx", "avx2", "fma", "f16c"}), "AMD EPYC (test)", "injected"
)
AVX512_BF16 = cpu_caps.CpuCaps(
    "x86_64",
    frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}),
    "Xeon (test)",
    "injected",
)


def run_train(
    *overrides: str, env: dict | None = None, timeout: int = 240
) -> subprocess.CompletedProcess:
    """``python train.py`` in a subprocess, as a user runs it."""
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})},
    )


# --------------------------------------------------------------------------- 1. target.dtype=auto


def test_target_dtype_auto_is_the_default_and_follows_the_cpu(monkeypatch, caplog, tiny_target_dir):
    from draftsmith.distill.target.loading import resolve_target_dtype

    assert OmegaConf.load(ROOT / "conf/target/smollm2.yaml").dtype == "auto"
    dtype, why = resolve_target_dtype("auto", "cpu", AVX2)
    assert dtype == torch.float32 and why.startswith("auto -> fp32") and "no bf16" in why
    dtype, why = resolve_target_dtype("auto", "cpu", AVX512_BF16)
    assert dtype == torch.bfloat16 and why.startswith("auto -> bf16")
    assert (
        resolve_target_dtype("bf16", "cpu", AVX2)[0] == torch.bfloat16
    )  # explicit choices are kept
    assert resolve_target_dtype("fp32", "cpu", AVX512_BF16)[0] == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_target_dtype("int3", "cpu")

    # Target.load resolves auto for this machine's CPU and says what it chose, and why, in one log
    # line.
    for caps, want in ((AVX2, torch.float32), (AVX512_BF16, torch.bfloat16)):
        monkeypatch.setattr(cpu_caps, "probe", lambda caps=caps: caps)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="draftsmith.distill.target.loading"):
            target = Target.load(str(tiny_target_dir), "auto")
        assert target.lm_head_weight.dtype == want
        lines = [
            r.getMessage() for r in caplog.records if r.getMessage().startswith("target dtype:")
        ]
        assert (
            len(lines) == 1
            and ("-> bf16" if want == torch.bfloat16 else "-> fp32 (CPU has no bf16") in lines[0]
        )
    assert Target.load(str(tiny_target_dir), "fp32").lm_head_weight.dtype == torch.float32


# ---------------------------------------------------------------------- 2. CUDA-only presets on CPU


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer=gpu"],
        ["trainer=fsdp"],
        ["trainer=deepspeed_zero2"],
        ["trainer=ddp", "trainer.accelerator=gpu"],
    ],
)
def test_cuda_only_presets_without_cuda_name_the_cpu_preset(overrides):
    from draftsmith.distill.cluster.strategies import check_devices

    assert not torch.cuda.is_available()
    cfg = compose_config(["recipe=medusa", *overrides])
    with pytest.raises(
        ValueError, match=r"needs a CUDA GPU.*trainer=cpu.*trainer=ddp trainer.accelerator=cpu"
    ):
        check_devices(cfg.trainer)
    check_devices(cfg.trainer, cuda_available=True)  # the same preset is fine where CUDA exists
    check_devices(compose_config(["recipe=medusa", "trainer=ddp"]).trainer)  # CPU DDP passes


@pytest.mark.e2e  # a train.py / draftsmith subprocess
def test_gpu_preset_on_cpu_fails_with_one_line_before_loading(
    tmp_path, tiny_target_dir, tiny_data_file
):
    proc = run_train(
        "recipe=medusa",
        "trainer=gpu",
        f"target={tiny_target_dir}",
        f"data={tiny_data_file}",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "trainer=cpu" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "MisconfigurationException" not in proc.stderr


# -------------------------------------------------------------------------- 3. exact teacher logits


def _tiny_hf(kind: str) -> torch.nn.Module:
    """Random tiny HF models whose forward post-processes the LM head's output."""
    import transformers as tf

    common = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    if (
        kind == "gemma2"
    ):  # tanh(logits / cap) * cap, a small cap so that it visibly bends the logits
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, final_logit_softcapping=0.5)).eval()
    if kind == "granite":  # logits / logits_scaling
        return tf.GraniteForCausalLM(tf.GraniteConfig(**common, logits_scaling=4.0)).eval()
    return tf.CohereForCausalLM(
        tf.CohereConfig(**common, logit_scale=0.25)
    ).eval()  # logits * logit_scale


@pytest.mark.parametrize("kind", ["gemma2", "granite", "cohere"])
def test_teacher_logits_equal_the_hf_forward(kind):
    from draftsmith.runtime.target.hf import HFCache, HFModelAdapter

    model = _tiny_hf(kind)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # a right-padded row, as in training batches
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits  # [B, T, V]
    feats = Target(model, None, kind).features(ids, mask, FeatureTaps(logits=True, topk=3))
    raw = model.get_output_embeddings()(feats.final_hidden)
    assert (raw - want).abs().max() > 1e-2, (
        "the model's post-processing must matter for this test to mean anything"
    )
    torch.testing.assert_close(feats.logits, want, rtol=0, atol=1e-6)
    assert torch.equal(feats.topk_indices, want.topk(3, dim=-1).indices)

    # The runtime's HF fallback decoder returns the same logits, for every row selection.
    adapter = HFModelAdapter(model)
    row = ids[0]
    with torch.no_grad():
        full = model(input_ids=row[None]).logits[0]  # [T, V]
    for logits_for, rows in (
        ("all", slice(None)),
        ("last", slice(-1, None)),
        (torch.tensor([2, 5]), [2, 5]),
    ):
        out = adapter(row, HFCache(16), logits_for=logits_for)
        logits, hidden = out.logits, out.hidden
        torch.testing.assert_close(logits, full[rows], rtol=0, atol=1e-5)
        assert hidden.shape == (9, 32)


# -------------------------------------------------------------------- 4. EAGLE-1 noise and clipping


def test_eagle_noise_is_uniform_point_one_whatever_the_batch_width(tiny_tokenizer):
    from draftsmith.recipes import get_recipe
    from draftsmith.recipes.eagle import objective as eagle_recipe

    target = Target(build_tiny_llama(len(tiny_tokenizer)), tiny_tokenizer, "tiny")
    cfg = recipe_config("eagle")
    assert cfg.drafter.noise.kind == "uniform" and cfg.drafter.noise.scale == 0.1
    objective = eagle_recipe.build(cfg, target)
    objective.module.train()
    seen: list[torch.Tensor] = []
    forward = objective.module.forward
    objective.module.forward = lambda ids, features, **kw: (
        seen.append(features),
        forward(ids, features, **kw),
    )[1]
    torch.manual_seed(0)
    for width in (6, 24, 96):  # short and long length buckets
        ids = torch.randint(5, target.vocab_size, (4, width))
        batch = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "loss_mask": torch.ones_like(ids),
        }
        feats = target.features(ids, batch["attention_mask"], objective.taps)
        objective.loss(batch, feats)
        noise = seen[-1] - feats.final_hidden[:, : width - 2]
        assert noise.abs().max() <= 0.1 + 1e-6 and noise.abs().max() > 0.08, (
            width,
            noise.abs().max(),
        )
        assert abs(float(noise.mean())) < 0.02
    off = eagle_recipe.build(
        recipe_config("eagle", {"drafter": {"noise": {"kind": "none"}}}), target
    )
    assert torch.equal(off.noise(torch.ones(1, 3, 2)), torch.ones(1, 3, 2))
    with pytest.raises(ValueError, match="noise.kind"):
        get_recipe("eagle").validate(
            recipe_config("eagle", {"drafter": {"noise": {"kind": "gaussianish"}}})
        )


def test_eagle_clips_gradients_by_value_and_others_by_norm(tmp_path):
    from draftsmith.distill.engine.lightning_trainer import build_trainer

    eagle = build_trainer(compose_config(["recipe=eagle"]), tmp_path / "e")
    assert eagle.gradient_clip_val == 0.5 and eagle.gradient_clip_algorithm == "value"
    medusa = build_trainer(compose_config(["recipe=medusa"]), tmp_path / "m")
    assert medusa.gradient_clip_val == 1.0 and medusa.gradient_clip_algorithm == "norm"
    norm = build_trainer(
        compose_config(["recipe=eagle", "optim.grad_clip_algorithm=norm"]), tmp_path / "n"
    )
    assert norm.gradient_clip_algorithm == "norm"
    off = build_trainer(compose_config(["recipe=eagle", "optim.grad_clip=0"]), tmp_path / "o")
    assert off.gradient_clip_val is None


def test_a_wall_clock_budget_caps_training(tmp_path):
    from pytorch_lightning.callbacks import Timer

    from draftsmith.distill.engine.lightning_trainer import build_trainer

    capped = build_trainer(
        compose_config(["recipe=medusa", "trainer.max_time=00:00:04:30"]), tmp_path / "t"
    )
    timers = [c for c in capped.callbacks if isinstance(c, Timer)]
    assert len(timers) == 1 and timers[0]._duration == 270
    plain = build_trainer(compose_config(["recipe=medusa"]), tmp_path / "p")
    assert not any(isinstance(c, Timer) for c in plain.callbacks)


# --------------------------------------------------------------------------- 5. empty data


def test_empty_data_file_says_it_is_empty(tmp_path, tiny_tokenizer):
    from draftsmith.distill.data.conversations import load_conversations
    from draftsmith.distill.data.datamodule import ChatDataModule

    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("empty.json", "[]")):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ValueError, match=r"is empty"):
            load_conversations(str(path))
        data = ChatDataModule(
            tiny_tokenizer, str(path), max_length=48, batch_size=2, cache_dir=tmp_path / "cache"
        )
        with pytest.raises(ValueError, match=rf"{re.escape(name)} is empty"):
            data.prepare_data()
    no_reply = tmp_path / "users_only.jsonl"
    no_reply.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="none of its 1 record"):
        load_conversations(str(no_reply))


# --------------------------------------------------------------------------- 7. progress bar


def test_progress_bar_shows_steps_tokens_per_second_and_eta(tmp_path):
    from pytorch_lightning.callbacks import Timer

    from draftsmith.distill.engine.lightning_trainer import build_trainer
    from draftsmith.distill.engine.progress import (
        StepProgressBar,
        format_duration,
        max_time_left,
        progress_fields,
    )

    assert progress_fields(12, 200, 0, 12_000, 10.0) == {
        "step": "12/200",
        "tok/s": "1,200",
        "eta": "2m37s",
    }
    assert progress_fields(50, 200, 50, 0, 0.0) == {
        "step": "50/200",
        "tok/s": "?",
        "eta": "?",
    }  # just resumed
    # trainer.max_time ends the run first: the ETA is the time it still allows, not the step count's
    # pace
    assert progress_fields(12, 100_000, 0, 12_000, 10.0, time_left=125.0)["eta"] == "2m05s"
    assert progress_fields(12, 200, 0, 12_000, 10.0, time_left=3600.0)["eta"] == "2m37s"
    assert [format_duration(s) for s in (5, 65, 7300)] == ["5s", "1m05s", "2h01m"]
    from draftsmith.common.durations import eta_seconds

    assert (
        eta_seconds(0, 10, 5.0) is None
        and eta_seconds(2, 10, 5.0) == 20.0
        and eta_seconds(10, 10, 9.0) == 0
    )
    assert max_time_left(SimpleNamespace(callbacks=[Timer(duration="00:00:10:00")])) == 600.0
    assert max_time_left(SimpleNamespace(callbacks=[])) is None

    trainer = build_trainer(compose_config(["recipe=medusa"]), tmp_path)
    assert isinstance(trainer.progress_bar_callback, StepProgressBar)

    def bar_text(start: int, max_steps: int, reached: int, epoch_start: bool) -> str:
        bar = StepProgressBar()
        fake = SimpleNamespace(
            global_step=start,
            max_steps=max_steps,
            world_size=1,
            loggers=[],
            callbacks=[],
            progress_bar_metrics={"train/loss": 3.25},
        )
        module = SimpleNamespace(tokens_seen=0)
        bar.on_train_start(fake, module)
        if epoch_start:
            bar.on_train_epoch_start(fake, module)
        fake.global_step, module.tokens_seen = reached, 4_800
        bar.on_train_batch_end(fake, module, None, None, 59)
        text = str(bar.train_progress_bar)
        bar.train_progress_bar.close()
        return text

    text = bar_text(0, 200, 12, epoch_start=True)
    assert text.startswith("step 12/200") and "6%" in text, text
    assert re.search(r"tok/s=[\d,]+", text) and re.search(r"eta=\d+(s|m\d\ds|h\d\dm)", text), text
    assert "train/loss=3.25" in text and "Epoch" not in text and "60/60" not in text, text
    # resumed mid-epoch: Lightning calls no epoch start (the bar read "0%" at 2537/4400)
    text = bar_text(2500, 4400, 2537, epoch_start=False)
    assert text.startswith("step 2537/4400") and "58%" in text, text


def test_fsdp_norm_clipping_moves_into_the_module(tmp_path):
    """Lightning's FSDP precision refuses ``gradient_clip_algorithm='norm'`` (seen on an H100): the
    Trainer gets no clip and the module clips the global norm through the FSDP root instead; value
    clipping stays Lightning's.
    """
    from omegaconf import OmegaConf

    from draftsmith.distill.engine.lightning_trainer import grad_clipping, sharded_clip_norm

    medusa = compose_config(["recipe=medusa"])
    fsdp = OmegaConf.create({"strategy": "fsdp", "accelerator": "gpu"})
    assert grad_clipping(medusa.optim, fsdp) == {
        "gradient_clip_val": None,
        "gradient_clip_algorithm": None,
    }
    assert sharded_clip_norm(medusa.optim, fsdp) == 1.0
    assert sharded_clip_norm(medusa.optim, medusa.trainer) is None
    assert grad_clipping(medusa.optim, medusa.trainer)["gradient_clip_val"] == 1.0
    eagle = compose_config(["recipe=eagle"])
    assert sharded_clip_norm(eagle.optim, fsdp) is None
    assert grad_clipping(eagle.optim, fsdp)["gradient_clip_algorithm"] == "value"


def test_the_module_clips_the_global_norm_itself_when_told():
    """``configure_gradient_clipping`` with ``sharded_clip_norm`` calls the strategy root's
    ``clip_grad_norm_``."""
    from types import SimpleNamespace

    from draftsmith.distill.engine.module import DistillModule

    calls = []
    fake = SimpleNamespace(
        sharded_clip_norm=0.7,
        trainer=SimpleNamespace(
            strategy=SimpleNamespace(model=SimpleNamespace(clip_grad_norm_=calls.append))
        ),
    )
    DistillModule.configure_gradient_clipping(fake, optimizer=None, gradient_clip_val=None)
    assert calls == [0.7]


def test_validation_puts_the_drafter_buffers_and_whole_parameters_on_the_batch_device():
    """ZeRO-3's validate-after-fit left the frozen embedding buffer and then a norm weight (a
    parameter ZeRO-3 keeps whole, ``ds_persist``) on the CPU (H100 runs): the hook moves every
    drafter buffer and every parameter ZeRO-3 keeps whole to the strategy's root device (here
    "meta", so the move is visible on a CPU machine), and leaves a partitioned parameter's
    placeholder (ZeRO-3 gathers it) and any other parameter alone.
    """
    from types import SimpleNamespace

    from draftsmith.distill.engine.callbacks.zero3 import ZeroThreeDevices

    drafter = torch.nn.Sequential(
        torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    )
    drafter.register_buffer("embed_weight", torch.ones(3, 2), persistent=False)
    drafter[0].register_buffer("d2t", torch.arange(3))
    drafter[1].weight.ds_id, drafter[1].weight.ds_persist = 7, True  # kept whole by ZeRO-3
    drafter[2].weight.ds_id, drafter[2].weight.ds_persist = 8, False  # partitioned: a placeholder
    fake = SimpleNamespace(
        drafter=drafter,
        trainer=SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("meta"))),
    )
    ZeroThreeDevices().on_validation_start(fake.trainer, fake)
    assert drafter.embed_weight.device.type == "meta" and drafter[0].d2t.device.type == "meta"
    assert "embed_weight" not in drafter.state_dict()  # still non-persistent
    assert drafter[1].weight.device.type == "meta"  # kept whole by ZeRO-3: moved
    assert drafter[2].weight.device.type == "cpu"  # partitioned: left to ZeRO-3
    assert (
        drafter[0].weight.device.type == "cpu"
    )  # not DeepSpeed's (e.g. FSDP cpu_offload): left to the strategy
    assert (
        drafter[1].weight.ds_id == 7 and drafter[1].weight.ds_persist
    )  # same object, DeepSpeed attributes kept
