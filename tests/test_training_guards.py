"""What guards a training run's setup and its reports: target dtype auto, CUDA-only presets on CPU,
exact teacher logits, EAGLE-1 noise, the wall-clock budget, empty data and validation on the batch
device (the non-finite-loss message: test_training_scores_nothing.py; train.py's one-line errors:
test_train_errors.py; gradient clipping: test_fused_clipping.py; the progress bar:
test_training_progress_bar.py)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

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
    # explicit choices are kept
    assert resolve_target_dtype("bf16", "cpu", AVX2)[0] == torch.bfloat16
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
    # tanh(logits / cap) * cap, a small cap so that it visibly bends the logits
    if kind == "gemma2":
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


# ------------------------------------------------------------------------------ 4. EAGLE-1 noise


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


# ------------------------------------------------------------- 6. validation on the batch device


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
    # not DeepSpeed's (e.g. FSDP cpu_offload): left to the strategy
    assert drafter[0].weight.device.type == "cpu"
    # same object, DeepSpeed attributes kept
    assert drafter[1].weight.ds_id == 7 and drafter[1].weight.ds_persist
