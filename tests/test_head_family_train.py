"""`train.py recipe=hydra|hydra_pp|clover2|medusa2` end to end on a tiny target (in-process, 2 steps
each): the export, its inference block and weight parts, and the checkpoint export that reproduces
it."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from draftsmith.export.format import read_export_parts

pytestmark = pytest.mark.e2e

CONF = Path(__file__).resolve().parents[1] / "conf"
RECIPES = {
    "hydra": ["heads.num_heads=2"],
    "hydra_pp": ["heads.num_heads=2", "heads.num_layers=2"],
    "clover2": ["heads.num_heads=2", "heads.num_layers=1"],
    "medusa2": ["heads.num_heads=2", "heads.warmup_steps=1", "adapter.rank=2"],
}


def compose_cfg(name: str, target: Path, data: Path, *extra: str):
    import train  # noqa: F401  (registers the `slug` resolver the config uses)

    overrides = [
        f"recipe={name}",
        f"target.name_or_path={target}",
        "target.dtype=fp32",
        f"data.spec={data}",
        "data.limit=null",
        "data.max_length=32",
        "data.batch_size=4",
        "data.val_fraction=0.1",
        "trainer.max_steps=2",
        "trainer.log_every_n_steps=1",
        "run.checkpoint_every=2",
        "run.final_eval_batches=1",
        "optim.warmup_steps=0",
        "logger=csv",
        *RECIPES[name],
        *extra,
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_train_exports_each_head_family_recipe(
    name, tmp_path, tiny_target_dir, tiny_data_file, monkeypatch
):
    if name == "medusa2":
        pytest.importorskip("peft")

    monkeypatch.syspath_prepend(str(CONF.parent))
    from draftsmith.distill.engine.exporting import export_from_checkpoint
    from draftsmith.distill.engine.trainer import train
    from draftsmith.recipes import get_recipe

    cfg = compose_cfg(name, tiny_target_dir, tiny_data_file)
    summary = train(cfg, get_recipe(name), tmp_path / "run")
    assert summary["steps"] == 2
    config, parts = read_export_parts(summary["export"])
    inference = config["inference"]
    assert config["method"] == name == inference["proposer"] and config["training"]["steps"] == 2
    assert inference["verifier"] == "greedy" and inference["tree"] and inference["top_k"] == 10
    # the end-of-training validation pass measured the heads
    assert inference["tree_source"] == "calibrated"
    assert len(inference["head_accuracies"]) == 2
    assert set(parts) == ({"model", "adapter"} if name == "medusa2" else {"model"})
    if name == "medusa2":
        assert config["target"]["adapter"]["kind"] == "lora" and inference["adapter"]["rank"] == 2
        assert (
            summary["metrics"]["val/agree_original_top1"] > 0.5
            and "val/original_ce" in summary["metrics"]
        )
    # the runtime rebuilds the heads from the export with the target's frozen weights passed in
    else:
        from transformers import AutoModelForCausalLM

        from draftsmith.heads.clover import CloverHeads
        from draftsmith.heads.hydra import HydraHeads

        hf = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
        embed, lm_head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
        cls = CloverHeads if name == "clover2" else HydraHeads
        heads, _ = cls.from_export(summary["export"], embed_weight=embed, lm_head_weight=lm_head)
        assert all(torch.equal(v, parts["model"][k]) for k, v in heads.state_dict().items())
    # `draftsmith export RUN_DIR` reproduces the end-of-training export, parts included.
    _, again = read_export_parts(export_from_checkpoint(tmp_path / "run", tmp_path / "from_ckpt"))
    assert again.keys() == parts.keys()
    for part in parts:
        assert parts[part].keys() == again[part].keys()
        assert all(torch.equal(parts[part][k], again[part][k]) for k in parts[part])
