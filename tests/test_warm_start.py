"""Warm start (``run.init_from=EXPORT``, distill/engine/warm_start.py): the drafter starts from the
export's weights (stored fp32 or bf16), a drafter for another target or of another shape is refused
in one line, the data order goes on at the batch after the export's last, the record accumulates
across runs, and a resumed run reads the record it kept (a damaged one refused in one line)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from draftsmith.common.errors import ConfigError
from draftsmith.distill.data.datamodule import ChatDataModule
from draftsmith.distill.engine import warm_start
from draftsmith.distill.target.frozen import Target
from draftsmith.export.format import ExportError, TargetMismatchError, read_export

pytestmark = pytest.mark.unit


def _objective(target: Target, num_heads: int = 2, seed: int = 1):
    from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
    from draftsmith.recipes.medusa.objective import MedusaObjective, default_tree

    torch.manual_seed(seed)
    heads = MedusaHeads(
        MedusaConfig(
            hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_heads=num_heads
        ),
        target.lm_head_weight.float(),
    )
    return MedusaObjective(
        heads, 0.8, "dataset", 5, default_tree(num_heads, 6, 4), {"top_k": 4, "verifier": "greedy"}
    )


def _cfg(**data) -> OmegaConf:
    base = {
        "spec": "chat.jsonl",
        "limit": None,
        "max_length": 48,
        "batch_size": 4,
        "packing": False,
        "val_fraction": 0.1,
    }
    return OmegaConf.create(
        {
            "data": {**base, **data},
            "run": {"seed": 0, "init_from": None},
            "trainer": {
                "accumulate_grad_batches": 1,
                "devices": 1,
                "num_nodes": 1,
                "accelerator": "cpu",
            },
        }
    )


@pytest.fixture(scope="module")
def target(tiny_target_dir, tiny_tokenizer) -> Target:
    return Target(
        AutoModelForCausalLM.from_pretrained(tiny_target_dir), tiny_tokenizer, str(tiny_target_dir)
    )


def test_a_warm_start_loads_the_exports_weights_and_refuses_another_target_or_shape(
    tmp_path, target, medusa_export, tiny_tokenizer
):
    objective = _objective(target)
    _, exported = read_export(medusa_export)
    assert not all(
        torch.equal(objective.module.state_dict()[k], v) for k, v in exported.items()
    )  # another init
    prior = warm_start.load_init(str(medusa_export), objective, target)
    assert all(torch.equal(objective.module.state_dict()[k], v) for k, v in exported.items())
    # written before lineages
    assert prior["export"].startswith("sha256:") and prior["data_order"] is None

    other = Target(_other_llama(len(tiny_tokenizer)), tiny_tokenizer, "other-target")
    with pytest.raises(TargetMismatchError) as err:
        warm_start.load_init(str(medusa_export), _objective(other), other)
    assert "exported for target" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(
        ConfigError, match=r"its architecture differs from this run's \(num_heads 2 -> 3\)"
    ):
        warm_start.load_init(str(medusa_export), _objective(target, num_heads=3), target)

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in medusa_export.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a partial copy
    with pytest.raises(ExportError, match="corrupt or truncated") as err:
        warm_start.load_init(str(broken), _objective(target), target)
    assert "\n" not in str(err.value)


def _other_llama(vocab: int):
    from conftest import build_tiny_llama

    return build_tiny_llama(vocab, seed=5)


def test_the_data_order_goes_on_at_the_batch_after_the_exports_last(
    tiny_tokenizer, tiny_data_file, tmp_path
):
    def module(offset: int) -> ChatDataModule:
        dm = ChatDataModule(
            tiny_tokenizer,
            str(tiny_data_file),
            max_length=48,
            batch_size=4,
            val_fraction=0.1,
            cache_dir=tmp_path,
        )
        dm.trainer = SimpleNamespace(world_size=1, global_rank=0, accumulate_grad_batches=1)
        dm.step_offset = offset
        return dm

    plain = [b["input_ids"] for b in module(0).train_dataloader()]
    epoch = len(plain)
    assert epoch > 4
    for offset, first in (
        (3, 3),
        (epoch + 2, 2),
    ):  # an offset past an epoch wraps into the next one
        got = next(iter(module(offset).train_dataloader()))["input_ids"]
        assert torch.equal(got, plain[first])
    rest = [b["input_ids"] for b in module(3).train_dataloader()]
    assert len(rest) == epoch - 3  # the rest of the epoch, then the next starts at its beginning


def test_the_record_accumulates_and_continues_only_the_same_data_order(tmp_path):
    cfg = _cfg()
    order = warm_start.data_order(cfg)
    prior = {
        "data_order": order,
        "order_steps": 5,
        "steps_total": 5,
        "tokens_total": 1000,
        "wall_seconds_total": 10.0,
        "cpu_seconds_total": 20.0,
        "export": "sha256:abc",
        "runs": [{"steps": 5, "tokens": 1000}],
    }
    (tmp_path / warm_start.SITTINGS_FILE).write_text(
        json.dumps(
            [
                {"machine": "m1", "wall_seconds": 3.0, "cpu_seconds": 5.0, "steps": [0, 2]},
                {"machine": "m2", "wall_seconds": 4.0, "cpu_seconds": 6.0, "steps": [2, 3]},
            ]
        )
    )
    record = warm_start.lineage(cfg, prior, steps=3, tokens=300, run_dir=tmp_path)
    assert (
        record["order_steps"] == 8 and record["steps_total"] == 8 and record["tokens_total"] == 1300
    )
    assert record["wall_seconds_total"] == 17.0 and record["cpu_seconds_total"] == 31.0
    run = record["runs"][-1]
    assert (
        run["machines"] == ["m1", "m2"]
        and run["sittings"] == 2
        and run["data_order_continued"] is True
    )
    assert run["started_from"] == "sha256:abc" and len(record["runs"]) == 2
    other = warm_start.lineage(_cfg(max_length=96), prior, steps=3, tokens=300, run_dir=tmp_path)
    assert other["order_steps"] == 3 and other["runs"][-1]["data_order_continued"] is False
    assert other["tokens_total"] == 1300  # tokens accumulate whatever the data
    assert warm_start.continued_steps(prior, order) == 5
    assert warm_start.continued_steps(prior, warm_start.data_order(_cfg(batch_size=8))) == 0


def test_a_resumed_warm_start_reads_its_kept_record_and_refuses_a_damaged_one(tmp_path):
    cfg = _cfg()
    prior = {"data_order": warm_start.data_order(cfg), "order_steps": 7, "tokens_total": 1}
    (tmp_path / warm_start.WARM_FILE).write_text(json.dumps(prior))
    data = SimpleNamespace(step_offset=0)
    cfg.run.init_from = (  # the kept record wins on a resume: no export is read
        "/export/that/was/replaced/since"
    )
    assert warm_start.prepare(cfg, None, None, data, tmp_path, resuming=True) == prior
    assert data.step_offset == 7
    (tmp_path / warm_start.WARM_FILE).write_text('{"data_order": ')  # damaged
    with pytest.raises(
        ConfigError, match="warm_start.json \\(the warm start's record\\) is corrupt"
    ) as err:
        warm_start.prepare(cfg, None, None, data, tmp_path, resuming=True)
    assert "\n" not in str(err.value)
    assert (
        warm_start.prepare(_cfg(), None, None, data, Path(tmp_path / "fresh"), resuming=False)
        is None
    )


def test_an_export_from_before_lineages_gets_its_data_order_from_its_run_folder(tmp_path):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    cfg = _cfg(spec="sharegpt", max_length=512)
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    (run / ".hydra" / "overrides.yaml").write_text("- recipe=eagle3\n- data.max_length=512\n")
    old = {"method": "eagle3", "training": {"steps": 200, "tokens": 379314}}
    lineage = warm_start.lineage_from_run(run, old)
    assert lineage["data_order"] == warm_start.data_order(cfg) and lineage["order_steps"] == 200
    assert lineage["tokens_total"] == 379314
    assert lineage["runs"][-1]["command"] == "train.py recipe=eagle3 data.max_length=512"
    # no run config: unknown
    assert warm_start.lineage_from_run(tmp_path / "elsewhere", old)["data_order"] is None
