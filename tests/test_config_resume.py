"""Resuming into a run folder (issue 40's training parts): a checkpoint of another recipe is
refused before the target loads and one of another shape names the changed key, each in one line
with what to do; a checkpoint folder or damaged file is left to Lightning; a re-run with more heads
in the same folder stops in one line."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from draftsmith.cli.training import compose_config
from draftsmith.common.errors import ConfigError

pytestmark = pytest.mark.unit


def fake_checkpoint(recipe: str, config: dict, state: dict[str, torch.Tensor]) -> dict:
    return {"state_dict": state, "draftsmith": {"recipe": recipe, "config": config}}


def test_a_checkpoint_of_another_recipe_is_refused_before_the_target_loads(tmp_path):
    from draftsmith.distill.engine.resume_check import check_resume_recipe

    cfg = compose_config(["recipe=eagle3"])
    with pytest.raises(
        ConfigError,
        match=r"holds a recipe=medusa checkpoint \(ck\.ckpt\), and this run is "
        r"recipe=eagle3.*hydra\.run\.dir=NEW_DIR.*run\.resume=false",
    ):
        check_resume_recipe(fake_checkpoint("medusa", {}, {}), "ck.ckpt", cfg, tmp_path)
    check_resume_recipe(
        fake_checkpoint("eagle3", {}, {}), "ck.ckpt", cfg, tmp_path
    )  # same recipe: fine


def test_a_checkpoint_of_another_shape_names_the_changed_key(tmp_path):
    from draftsmith.distill.engine.resume_check import check_resume_shapes

    cfg = compose_config(["recipe=medusa", "heads.num_heads=5"])
    saved = OmegaConf.to_container(
        compose_config(["recipe=medusa", "heads.num_heads=3", "optim.lr=0.1"])
    )
    module = torch.nn.Linear(4, 5)
    ckpt = fake_checkpoint("medusa", saved, {"weight": torch.zeros(3, 4), "bias": torch.zeros(3)})
    with pytest.raises(ConfigError) as err:
        check_resume_shapes(ckpt, "run/checkpoints/step-6.ckpt", cfg, module, tmp_path)
    message = str(err.value)
    assert message.startswith(
        "cannot resume from run/checkpoints/step-6.ckpt: the model's shape changed "
        "(heads.num_heads 3 -> 5); 2 weight(s) differ, e.g. bias (3,) vs (5,)"
    ), message
    assert (
        "optim.lr" not in message and "run.resume=false" in message and "hydra.run.dir=" in message
    )
    same = fake_checkpoint("medusa", saved, {k: v.detach() for k, v in module.state_dict().items()})
    check_resume_shapes(same, "x.ckpt", cfg, module, tmp_path)  # same shapes: resumes


def test_a_checkpoint_folder_or_damaged_file_is_left_to_lightning(tmp_path):
    from draftsmith.distill.engine.resume_check import check_resume_shapes, read_checkpoint

    damaged = tmp_path / "last.ckpt"
    damaged.write_bytes(b"not a checkpoint")
    # DeepSpeed folder, damaged file
    assert read_checkpoint(tmp_path) == {} and read_checkpoint(damaged) == {}
    check_resume_shapes(
        {}, str(damaged), compose_config(["recipe=medusa"]), torch.nn.Linear(2, 2), tmp_path
    )


@pytest.mark.e2e  # two short training runs in one run folder
def test_rerunning_with_more_heads_in_the_same_folder_is_one_line(
    tmp_path, tiny_target_dir, tiny_data_file
):
    from draftsmith import recipes
    from draftsmith.distill.engine.trainer import train

    base = [
        "recipe=medusa",
        f"target.name_or_path={tiny_target_dir}",
        "target.dtype=fp32",
        f"data.spec={tiny_data_file}",
        "data.limit=null",
        "data.max_length=48",
        "data.batch_size=4",
        "data.val_fraction=0.1",
        "trainer.max_steps=2",
        "run.checkpoint_every=2",
        "run.final_eval_batches=1",
        "run.export=false",
        "validation.served_tau.every=0",
    ]
    train(compose_config([*base, "heads.num_heads=2"]), recipes.get_recipe("medusa"), tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"the model's shape changed \(heads\.num_heads 2 -> 3\).*run\.resume=false",
    ):
        train(compose_config([*base, "heads.num_heads=3"]), recipes.get_recipe("medusa"), tmp_path)
    with pytest.raises(ConfigError, match=r"holds a recipe=medusa checkpoint"):
        train(
            compose_config([*base[1:], "recipe=hydra", "heads.num_heads=2"]),
            recipes.get_recipe("hydra"),
            tmp_path,
        )
