"""A GPU step must never wait for the device: one EAGLE-3 training run on packed rows, through
Lightning as train.py runs it, makes no data-dependent op and no device read-back outside log steps
(counted on the CPU with a ``TorchDispatchMode`` hook plus the Python-level read-backs), and makes
them on log steps (the counter works).
"""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
import pytorch_lightning as pl
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from draftsmith.cli.training import compose_config

pytestmark = pytest.mark.unit

aten = torch.ops.aten
READ_BACK = {
    aten._local_scalar_dense,
    aten.equal,
    aten.is_nonzero,
    aten.allclose,
}  # .item(), bool(), int(), ...
DATA_DEPENDENT = {
    aten.nonzero,
    aten.masked_select,
    aten.masked_scatter,
    aten.unique_consecutive,
    aten._unique2,
    aten.unique_dim,
    aten.repeat_interleave,
}  # output shapes that depend on values
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
# The batch is still on the host in these (a CPU tensor there is not a device round trip).
HOST_SIDE = ("on_before_batch_transfer", "torch/utils/data/")
PYTHON_READS = ("cpu", "tolist", "numpy", "item")


class SyncCounter(TorchDispatchMode):
    """Counts read-backs and data-dependent ops per training batch (``current``: the batch index
    being counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = -1
        self.counts: Counter = Counter()
        self.where: dict[int, list[str]] = {}

    def note(self, what: str) -> None:
        stack = "".join(traceback.format_stack(limit=40))
        if self.current < 0 or any(marker in stack for marker in HOST_SIDE):
            return
        self.counts[self.current] += 1
        frames = [
            f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
            for f in traceback.extract_stack(limit=12)
        ]
        self.where.setdefault(self.current, []).append(
            f"{what} <- {' < '.join(reversed(frames[:-2]))}"
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in READ_BACK or packet in DATA_DEPENDENT:
            self.note(str(packet))
        elif packet in INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else [])
        ):
            self.note(f"{packet} with a boolean index")
        return func(*args, **(kwargs or {}))


class CountPerBatch(pl.Callback):
    """Opens the counter at the first batch and moves it to the next batch index at each batch
    start, so that everything from one batch start to the next (step, backward, optimizer, logging,
    progress bar, checkpoints) counts for that batch."""

    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.counter.current = int(trainer.global_step)


@pytest.fixture()
def python_reads(monkeypatch, request):
    """Counts ``Tensor.cpu() / .tolist() / .numpy() / .item()`` calls made from Python (a CPU
    tensor's ``.cpu()`` is a no-op the dispatcher never sees)."""
    counter: SyncCounter = request.getfixturevalue("counter")
    for name in PYTHON_READS:
        original = getattr(torch.Tensor, name)

        def wrapped(self, *args, _original=original, _name=name, **kwargs):
            counter.note(f"Tensor.{_name}()")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapped)


@pytest.fixture()
def counter() -> SyncCounter:
    return SyncCounter()


def test_an_eagle3_step_reads_nothing_back_outside_log_steps(
    tmp_path, monkeypatch, tiny_target_dir, tiny_data_file, counter, python_reads
):
    from draftsmith.distill.data.datamodule import build_datamodule
    from draftsmith.distill.engine.lightning_trainer import apply_precision, build_trainer
    from draftsmith.distill.engine.module import DistillModule
    from draftsmith.distill.target.frozen import Target
    from draftsmith.recipes import get_recipe

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    cfg = compose_config(
        [
            "recipe=eagle3",
            f"target.name_or_path={tiny_target_dir}",
            "target.dtype=fp32",
            f"data.spec={tiny_data_file}",
            "data.limit=null",
            "data.max_length=48",
            "data.tokens_per_step=192",
            "data.val_fraction=0.1",
            "drafter.target_layers=[1,2,3]",
            "drafter.draft_vocab_size=40",
            "trainer.max_steps=7",
            "trainer.log_every_n_steps=3",
            "trainer.precision=32-true",
            "run.checkpoint_every=1000",
            "run.final_eval_batches=0",
            "optim.warmup_steps=2",
            "logger=csv",
        ]
    )
    apply_precision(cfg)
    target = Target.load(str(tiny_target_dir), "fp32")
    objective = get_recipe("eagle3").build(cfg, target)
    data = build_datamodule(cfg, target.tokenizer)
    module = DistillModule(objective, target, dict(cfg.optim), total_steps=7)
    trainer = build_trainer(cfg, tmp_path / "run", callbacks=[CountPerBatch(counter)])
    with counter:
        trainer.fit(module, datamodule=data)
    assert trainer.global_step == 7
    log_steps = {2, 5, 6}  # (step + 1) % 3 == 0, and the last step
    quiet = {step: counter.where.get(step, []) for step in range(7) if step not in log_steps}
    assert all(not calls for calls in quiet.values()), "\n".join(
        c for calls in quiet.values() for c in calls[:5]
    )
    assert all(
        counter.counts[step] > 0 for step in log_steps
    )  # the counter sees the log steps' reads
    batches = list(data.train_dataloader())
    # 192 tokens: 4 packed rows
    assert batches[0]["input_ids"].shape == (4, 48) and "document_ids" in batches[0]
    expected = sum(
        int(b["attention_mask"].sum()) for b in (batches * 7)[:7]
    )  # counted on the host, every step
    assert module.tokens_seen == expected
