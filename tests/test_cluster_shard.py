"""``target.shard=true`` under FSDP: the frozen target's decoder layers sharded with PyTorch FSDP2
over 2 CPU processes (gloo) give exactly the features of the replicated target while each rank holds
half of the layers.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import build_tiny_llama, build_tiny_tokenizer
from torch.distributed.fsdp import fully_shard  # noqa: F401 - imported before fork
from transformers import LlamaForCausalLM  # noqa: F401 - imported before fork: children inherit it

from draftsmith.distill.target.frozen import FeatureTaps, Target
from draftsmith.distill.target.shard import shard_with_fsdp

pytestmark = pytest.mark.unit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tok = build_tiny_tokenizer()
        target = Target(
            build_tiny_llama(len(tok)), tok, "tiny"
        )  # same seed on both ranks: identical weights
        ids = torch.randint(5, len(tok), (2, 10), generator=torch.Generator().manual_seed(rank))
        taps = FeatureTaps(final_hidden=True, layers=(1, 2, 3), logits=True)
        want = target.features(ids, torch.ones_like(ids), taps)
        full = sum(p.numel() for layer in target.model.model.layers for p in layer.parameters())
        n = shard_with_fsdp(target.model)
        target.to(
            "cpu"
        )  # DistillModule.on_fit_start moves the target after sharding: must stay sharded and work
        local = sum(
            p.to_local().numel() for layer in target.model.model.layers for p in layer.parameters()
        )
        got = target.features(ids, torch.ones_like(ids), taps)
        diff = max(
            float((got.final_hidden - want.final_hidden).abs().max()),
            float((got.logits - want.logits).abs().max()),
            *(float((got.layer_hidden[i] - want.layer_hidden[i]).abs().max()) for i in taps.layers),
        )
        frozen = all(not p.requires_grad for p in target.parameters())
        Path(out, f"{rank}.json").write_text(
            json.dumps({"layers": n, "full": full, "local": local, "diff": diff, "frozen": frozen})
        )
    finally:
        dist.destroy_process_group()


def test_fsdp_sharded_target_matches_replicated_target(tmp_path):
    # fork: the children inherit the imported modules (spawn would re-import torch and transformers
    # twice)
    mp.start_processes(
        _worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method="fork"
    )
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for res in results:
        assert res["layers"] == 4 and res["frozen"]
        assert res["local"] == res["full"] // 2  # each rank holds half of every decoder layer
        assert res["diff"] == 0.0  # exact: all-gathered weights are the same numbers


def _eagle3_fsdp_case() -> tuple[Target, object, dict[str, torch.Tensor]]:
    """The tiny target, an EAGLE-3 config with the FSDP preset, and a batch (the same on every
    rank)."""
    from draftsmith.cli.training import compose_config

    tok = build_tiny_tokenizer()
    target = Target(build_tiny_llama(len(tok)), tok, "tiny")
    cfg = compose_config(
        [
            "recipe=eagle3",
            "trainer=fsdp",
            "drafter.target_layers=[1,2,3]",
            "drafter.draft_vocab_size=0",
            "drafter.ttt_steps=2",
        ]
    )
    ids = torch.randint(
        5, len(tok), (2, 12), generator=torch.Generator().manual_seed(0)
    )  # same on both ranks
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
    }
    return target, cfg, batch


def _sharded_gradients(objective, cfg, batch, feats) -> tuple[list[str], dict[str, torch.Tensor]]:
    """One backward of ``objective``'s loss wrapped by the preset's FSDP policy: the FSDP units'
    class names and every parameter's full gradient (by the unwrapped name)."""
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from draftsmith.distill.cluster.strategies import build_strategy

    class Step(nn.Module):  # the root unit, as Lightning makes the LightningModule the root
        def __init__(self) -> None:
            super().__init__()
            self.drafter = objective.module

        def forward(self, batch, feats):
            return objective.loss(batch, feats)[0]

    strategy = build_strategy(cfg.trainer, objective.module)
    model = FSDP(
        Step(),
        auto_wrap_policy=strategy.kwargs["auto_wrap_policy"],
        use_orig_params=True,
        device_id=torch.device("cpu"),
        sharding_strategy=strategy.sharding_strategy,
    )
    units = sorted(type(m.module).__name__ for m in model.modules() if isinstance(m, FSDP))
    model(batch, feats).backward()
    with FSDP.summon_full_params(model, with_grads=True):
        got = {
            n.replace("_fsdp_wrapped_module.", "").removeprefix("drafter."): p.grad.clone()
            for n, p in model.module.named_parameters()
        }
    return units, got


def _fsdp_drafter_worker(rank: int, world: int, port: int, out: str) -> None:
    """The preset's FSDP policy on a real EAGLE-3 drafter: units, and one step's gradients vs the
    unsharded drafter."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from draftsmith import recipes

        target, cfg, batch = _eagle3_fsdp_case()

        def build():
            torch.manual_seed(0)
            return recipes.get_recipe("eagle3").build(cfg, target)

        reference = build()
        feats = target.features(batch["input_ids"], batch["attention_mask"], reference.taps)
        reference.loss(batch, feats)[0].backward()
        want = {n: p.grad.clone() for n, p in reference.module.named_parameters()}
        units, got = _sharded_gradients(build(), cfg, batch, feats)
        diff = max(float((got[n] - want[n]).abs().max()) for n in want)
        Path(out, f"fsdp{rank}.json").write_text(
            json.dumps({"units": units, "diff": diff, "keys": sorted(got) == sorted(want)})
        )
    finally:
        dist.destroy_process_group()


def test_fsdp_preset_wraps_eagle3_layer_and_matches_unsharded_gradients(tmp_path):
    mp.start_processes(
        _fsdp_drafter_worker,
        args=(2, _free_port(), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="fork",
    )
    for rank in range(2):
        res = json.loads((tmp_path / f"fsdp{rank}.json").read_text())
        assert res["units"] == ["Eagle3Layer", "Step"] and res["keys"]
        # FSDP averages identical per-rank gradients: the unsharded gradient
        assert res["diff"] < 1e-6, res
