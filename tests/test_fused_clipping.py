"""Gradient clipping with the fused AdamW (:meth:`DistillModule._fused_optimizer`): under
``bf16-mixed`` (no GradScaler) the fused optimizer is kept and the module clips the global norm
itself (Lightning's mixed precision refuses to clip for any fused optimizer); under ``16-mixed`` (a
GradScaler) a clipped run gets the unfused AdamW, whose gradients Lightning unscales before the
clip. Which clipping each recipe gets (EAGLE by value, the others by norm), and the norm clipping
that moves into the module under FSDP."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from draftsmith.cli.training import compose_config
from draftsmith.distill.engine.module import DistillModule
from draftsmith.distill.engine.objective import Objective
from draftsmith.distill.target.frozen import FeatureTaps

pytestmark = pytest.mark.unit


class LargeGradientObjective(Objective):
    """A linear drafter whose loss has a gradient norm far above the clip (own features: no target
    forward)."""

    taps = FeatureTaps()

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.module = torch.nn.Linear(8, 8)

    def features(self, target, batch):
        return None

    def loss(self, batch, feats):
        return (self.module(batch["inputs"]) * 30.0).square().mean(), {}


class NoTarget(torch.nn.Module):
    """The target seat: nothing to run (the objective makes its own features)."""


def batches(n: int = 3) -> DataLoader:
    ids = torch.ones(2, 4, dtype=torch.long)
    return DataLoader(
        [{"inputs": torch.randn(2, 8), "input_ids": ids, "attention_mask": ids} for _ in range(n)],
        batch_size=None,
    )


def fit(precision: MixedPrecision, monkeypatch) -> tuple[DistillModule, list[float]]:
    """Three steps with ``gradient_clip_val=0.5``; returns the module and the global gradient norms
    after each clip."""
    after_clip: list[float] = []
    clip = torch.nn.utils.clip_grad_norm_

    def recording_clip(parameters, max_norm, *args, **kwargs):
        parameters = list(parameters)
        total = clip(parameters, max_norm, *args, **kwargs)
        after_clip.append(
            float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in parameters])))
        )
        return total

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
    module = DistillModule(LargeGradientObjective(), NoTarget(), {"lr": 1e-3}, total_steps=3)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[precision],
        max_steps=3,
        gradient_clip_val=0.5,
        gradient_clip_algorithm="norm",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, train_dataloaders=batches(), val_dataloaders=None)
    return module, after_clip


def test_bf16_mixed_keeps_the_fused_adamw_and_clips_the_global_norm(monkeypatch):
    module, after_clip = fit(MixedPrecision("bf16-mixed", "cpu"), monkeypatch)
    assert module.trainer.optimizers[0].defaults["fused"] is True
    assert len(after_clip) == 3 and all(norm <= 0.5 + 1e-4 for norm in after_clip), after_clip


def test_16_mixed_with_clipping_takes_the_unfused_adamw(monkeypatch):
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=4.0
    )  # a GradScaler, as on a GPU (a scale fp16 holds here)
    module, after_clip = fit(MixedPrecision("16-mixed", "cpu", scaler=scaler), monkeypatch)
    assert not module.trainer.optimizers[0].defaults["fused"]
    assert after_clip and all(norm <= 0.5 + 1e-4 for norm in after_clip), after_clip


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
